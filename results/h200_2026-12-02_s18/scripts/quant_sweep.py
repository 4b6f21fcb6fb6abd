"""GPU: the one-token layer (quantizer + GEMV) with the quantizer's blocks a program and warps, and the
GEMV's rows a program, swept; RAC 0.5, Qwen3 shapes. Not a change to rac: its quantizer launcher is
re-executed here with two knobs."""
import sys, math, inspect, itertools, torch
sys.path.insert(0, ".devnext/s18")
import rac, nvfp4
from gemv_gpu_common import graph_us
src = inspect.getsource(rac.quantize_activation_triton)
src = src.replace("blocks = 32 if n_blocks <= 16384 else 128", "blocks = SWEEP[0]")
src = src.replace("**_launch_options(device, early=", "num_warps=SWEEP[1], **_launch_options(device, early=")
assert "SWEEP[0]" in src and "SWEEP[1]" in src
ns = vars(rac)
ns["SWEEP"] = [32, 4]
exec(src, ns)
bf16 = torch.bfloat16
torch.manual_seed(0)
splits_qkv = (4096, 512, 512)
for name, N, K, splits in (("q", 4096, 2048, None), ("kv", 512, 2048, None), ("o", 2048, 4096, None),
                           ("qkv", 5120, 2048, splits_qkv)):
    w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
    w_q = (rac.stack_weights([nvfp4.quantize_weight(p) for p in w.split(splits)]) if splits
           else nvfp4.quantize_weight(w))
    n = max(1, min(64, math.ceil(180e6 / (N * K * 0.5625))))
    wqs = [nvfp4.NVFP4Tensor(w_q.data.clone(), w_q.block_scale.clone(), w_q.global_scale.clone()) for _ in range(n)]
    x = torch.randn(1, K, device="cuda", dtype=bf16)
    mask = torch.arange(K // 16, device="cuda") % 2 == 0
    ns["SWEEP"][:] = [32, 4]
    ref = rac.nvfp4_linear_triton(x, w_q, mask, splits=splits)
    ref = torch.cat([r.reshape(-1) for r in ref]) if splits else ref.reshape(-1)
    res = []
    for blocks, warps, rows in itertools.product((8, 16, 32, 128), (1, 2, 4), (2, 4, 8)):
        ns["SWEEP"][:] = [blocks, warps]
        rac.GEMV_ROWS = rows
        out = rac.nvfp4_linear_triton(x, w_q, mask, splits=splits)
        out = torch.cat([r.reshape(-1) for r in out]) if splits else out.reshape(-1)
        t = graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask, splits=splits) for w in wqs])
        res.append((t, blocks, warps, rows, torch.equal(out, ref)))
    res.sort()
    print(name, "default (32 blocks, 4 warps, 4 rows):", [f"{t:.1f}" for t, b, w, r, _ in res if (b, w, r) == (32, 4, 4)],
          "best:", "; ".join(f"{b}/{w}w/{r}r {t:.1f}{'' if ok else ' DIFFERS'}" for t, b, w, r, ok in res[:6]), flush=True)
    rac.GEMV_ROWS = 4
