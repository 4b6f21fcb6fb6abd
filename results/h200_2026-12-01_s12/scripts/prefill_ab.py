"""Prefill (M = 4096) W4A4 layer, one harness for any tree on PYTHONPATH: rac.nvfp4_linear_triton(x, w_q[, mask]),
CUDA graph of 10 calls replayed, median of 30; BF16 F.linear beside it as a drift check."""
import sys, torch, nvfp4, rac
import torch.nn.functional as F
print(rac.__file__)

def graph_us(fn, n=10, reps=30):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / n)
    return sorted(ts)[len(ts) // 2]

torch.manual_seed(0)
M, bf16 = 4096, torch.bfloat16
for name, N, K in [("q", 4096, 2048), ("kv", 512, 2048), ("o", 2048, 4096)]:
    w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
    w_q = nvfp4.quantize_weight(w)
    x = torch.randn(M, K, device="cuda", dtype=bf16)
    mask = torch.arange(K // 16, device="cuda") % 2 == 0
    t_bf16 = graph_us(lambda: F.linear(x, w))
    t_w4a4 = graph_us(lambda: rac.nvfp4_linear_triton(x, w_q))
    t_rac = graph_us(lambda: rac.nvfp4_linear_triton(x, w_q, mask))
    print(f"{name} bf16 {t_bf16:.1f} w4a4 {t_w4a4:.1f} rac0.5 {t_rac:.1f}", flush=True)
kern = getattr(rac, "_dense_kernel", None) or getattr(rac, "_w4a4_kernel")
for key, c in kern.cache.items():
    print("  pick", key[:5], c.kwargs, c.num_warps, c.num_stages)
if "force" in sys.argv:
    import triton
    torch.manual_seed(0)
    all_configs = list(kern.configs)
    for name, N, K in [("q", 4096, 2048), ("kv", 512, 2048), ("o", 2048, 4096)]:
        w_q = nvfp4.quantize_weight(torch.randn(N, K, device="cuda", dtype=bf16) * 0.02)
        x = torch.randn(M, K, device="cuda", dtype=bf16)
        for c in all_configs:
            if c.kwargs["BUCKET"] != 4096:
                continue
            kern.configs = [c]; kern.cache.clear()
            print(f"  {name} forced {c.kwargs['BLOCK_M']}/{c.kwargs['BLOCK_N']}/{c.kwargs['BLOCK_K']} {c.num_warps}w "
                  f"{c.num_stages}s: {graph_us(lambda: rac.nvfp4_linear_triton(x, w_q)):.1f}", flush=True)
    kern.configs = all_configs; kern.cache.clear()
