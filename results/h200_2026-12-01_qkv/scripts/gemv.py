"""M = 1 / 16 dense W4A4 layer times (CUDA-graph replays, weights rotated), every GEMV config forced."""
import math, os, sys
import torch, triton, triton.testing
import nvfp4, rac
tag = "old" if os.environ.get("RAC_EXP_GEMV_OLD") else "weight-first"
torch.manual_seed(0)
def graph_us(calls):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for c in calls: c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls: c()
    return triton.testing.do_bench(g.replay, return_mode="median") * 1e3 / len(calls)
k = rac._dense_kernel
for name, N, K in (("q", 4096, 2048), ("kv", 512, 2048), ("o", 2048, 4096)):
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    wq = nvfp4.quantize_weight(w)
    n = max(1, min(64, math.ceil(180e6 / (N * K * 0.5625))))
    ws = [nvfp4.NVFP4Tensor(wq.data.clone(), wq.block_scale.clone(), wq.global_scale.clone()) for _ in range(n)]
    for M in (1, 16):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        mask = torch.arange(K // 16, device="cuda") % 2 == 0
        y = rac.nvfp4_linear_triton(x, wq, mask, out_dtype=torch.float32)
        ref = rac.nvfp4_linear_reference(x, wq, mask).float()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        auto = graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask) for w in ws])
        plain = graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w) for w in ws])
        configs, picks = list(k.configs), dict(k.cache)
        forced = []
        bucket = rac._m_bucket(M, rac.DENSE_CONFIGS)
        for c in configs:
            if c.kwargs["BUCKET"] != bucket: continue
            k.configs = [c]; k.cache.clear()
            kw = c.kwargs
            forced.append(f"{kw['BLOCK_N']}/{kw['BLOCK_K']}/s{kw['SPLIT_K']}/{c.num_warps}w: "
                          f"{graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask) for w in ws]):.1f}")
        k.configs = configs; k.cache.clear(); k.cache.update(picks)
        print(f"{tag} {name} M={M}: rac0.5 {auto:.1f} us, no rac {plain:.1f} us, max rel err {err:.1e} | "
              + "; ".join(forced), flush=True)
