"""GPU: which part of the Gluon split-K prototype costs: weight layout, split-K reduction, program order."""
import sys, math, itertools, torch
sys.path.insert(0, "results/h200_2026-12-02_s19/scripts")
import rac, nvfp4, gdense
from gemv_gpu_common import graph_us
bf16 = torch.bfloat16
torch.manual_seed(0)
shapes = (("q", 4096, 2048), ("kv", 512, 2048), ("o", 2048, 4096), ("down", 2048, 6144))
for M in (1, 16):
    for name, N, K in shapes:
        w_q = nvfp4.quantize_weight(torch.randn(N, K, device="cuda", dtype=bf16) * 0.02)
        n = max(1, min(64, math.ceil(180e6 / (N * K * 0.5625))))
        wqs = [nvfp4.NVFP4Tensor(w_q.data.clone(), w_q.block_scale.clone(), w_q.global_scale.clone())
               for _ in range(n)]
        bqs = [rac.chunk_experts(nvfp4.NVFP4Tensor(q.data[None], q.block_scale[None], q.global_scale.reshape(1)))
               for q in wqs]
        x = torch.randn(M, K, device="cuda", dtype=bf16)
        mask = torch.arange(K // 16, device="cuda") % 2 == 0
        act = rac.quantize_activation_triton(x, mask)
        ref = rac.layer_matmul(act, w_q, torch.float32).reshape(-1)
        t_rac = graph_us([lambda w=w: rac.layer_matmul(act, w, bf16) for w in wqs])
        t_layer = graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask) for w in wqs])
        print(f"M={M} {name} {N}x{K}: rac GEMM alone {t_rac:.1f}, rac layer {t_layer:.1f}", flush=True)
        yz = torch.zeros(M * N, device="cuda", dtype=torch.float32)
        for S, blocked, reduce, k_fast in itertools.product((8, 16), (False, True), (1, 0, 2), (False, True)):
            if S == 8 and (reduce != 1 or not blocked):
                continue
            kw = dict(T=8 if M <= 8 else 16, BN=64, BK=128, S=S, W=4, reduce=reduce, k_fast=k_fast)
            if reduce == 1:
                out = gdense.dense_gluon(act, w_q, torch.float32, blocked=bqs[0] if blocked else None, **kw)
                out = gdense.dense_gluon(act, w_q, torch.float32, blocked=bqs[0] if blocked else None, **kw)
                err = ((out.reshape(-1) - ref).abs().max() / ref.abs().max()).item()
            else:
                err = float("nan")
            ydt = torch.float32 if reduce == 2 else bf16
            alone = graph_us([lambda w=w, b=b: gdense.dense_gluon(act, w, ydt, blocked=b if blocked else None,
                                                                  y=yz if reduce == 2 else None, **kw)
                              for w, b in zip(wqs, bqs)])
            layer = graph_us([lambda w=w, b=b: gdense.dense_gluon(
                rac.quantize_activation_triton(x, mask, early_launch=True), w, ydt, blocked=b if blocked else None,
                y=yz if reduce == 2 else None, **kw) for w, b in zip(wqs, bqs)])
            label = ['partials only', 'last arrives', 'atomic fp32'][reduce]
            print(f"  S {S:2d} {'blocked' if blocked else 'rowmaj '} reduce {label:13s} k_fast {int(k_fast)}: GEMM alone {alone:4.1f}, layer {layer:4.1f}"
                  f" (err {err:.1e})", flush=True)
