"""GPU: the full-K few-row GEMM prototype (gemv.gemm16) against rac's layer at M = 16."""
import sys, math, itertools, torch
sys.path.insert(0, ".devnext/s18")
import torch.nn.functional as F
import rac, nvfp4, bench, gemv as G
from gemv_gpu_common import graph_us
bf16 = torch.bfloat16
torch.manual_seed(0)
H_Q, H_KV, D = 4096, 512, 2048
splits_qkv = (H_Q, H_KV, H_KV)
for M in (16, 8):
    for name, N, K, splits in (("q", H_Q, D, None), ("kv", H_KV, D, None), ("o", D, H_Q, None),
                               ("qkv", sum(splits_qkv), D, splits_qkv)):
        w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
        w_q = (rac.stack_weights([nvfp4.quantize_weight(p) for p in w.split(splits)]) if splits
               else nvfp4.quantize_weight(w))
        n = max(1, min(64, math.ceil(180e6 / (N * K * 0.5625))))
        wqs = [nvfp4.NVFP4Tensor(w_q.data.clone(), w_q.block_scale.clone(), w_q.global_scale.clone()) for _ in range(n)]
        ws = [w.clone() for _ in range(max(1, min(64, math.ceil(180e6 / (N * K * 2)))))]
        x = torch.randn(M, K, device="cuda", dtype=bf16)
        mask = torch.arange(K // 16, device="cuda") % 2 == 0
        ref = rac.nvfp4_linear_triton(x, w_q, mask, splits=splits)
        ref = torch.cat([r.reshape(-1) for r in ref]) if splits else ref.reshape(-1)
        print(f"M={M} {name} {N}x{K}: bf16 {graph_us([lambda w=w: F.linear(x, w) for w in ws]):.1f}, "
              f"rac {graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask, splits=splits) for w in wqs]):.1f}", flush=True)
        for bn, bk, warps, prefetch in itertools.product((16, 32, 64), (128, 256), (4,), (False, True)):
            try:
                two = lambda w: G.gemm16(rac.quantize_activation_triton(x, mask, early_launch=True), w, splits=splits,
                                         block_n=bn, block_k=bk, warps=warps, prefetch=prefetch)
                out = two(w_q); out = torch.cat([r.reshape(-1) for r in out]) if splits else out.reshape(-1)
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                t = graph_us([lambda w=w: two(w) for w in wqs])
                print(f"  gemm16 bn {bn} bk {bk} warps {warps} prefetch {int(prefetch)}: {t:5.1f} us (vs rac {err:.1e})", flush=True)
            except Exception as e:
                print(f"  bn {bn} bk {bk} failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
