"""Experts' grouped GEMMs at decode (Qwen3-30B-A3B shapes, 128 experts top-8): each grouped configuration of
the call's bucket forced in turn, gate/up and down timed alone as CUDA-graph replays; then the autotuner's pick."""
import sys, torch, triton, moe, nvfp4, rac

def graph_us(fn, n=10, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
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
E, D, I, A = 128, 2048, 768, 8
gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02)
down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02)
kernel = rac._grouped_kernel
all_configs = list(kernel.configs)
for T in [int(t) for t in sys.argv[1:]] or [64, 256]:
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    counts = routing.counts.cpu()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    act_x = rac.quantize_activation_triton(x, torch.arange(D // 16, device="cuda") % 2 == 0)
    act_h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=torch.bfloat16),
                                           torch.arange(I // 16, device="cuda") % 2 == 0)
    row_weights = torch.rand(T * A, device="cuda")
    gu = lambda: rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True)
    dn = lambda: rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=row_weights)
    ref_gu, ref_dn = gu().float(), dn().float()
    bucket = rac._m_bucket(triton.cdiv(T * A, E), rac.GROUPED_CONFIGS)
    print(f"T={T} bucket {bucket}: rows an expert max {counts.max().item()}, >16: {(counts > 16).sum().item()}, "
          f">32: {(counts > 32).sum().item()}, 16-row tiles {((counts + 15) // 16).sum().item()}, "
          f"32-row tiles {((counts + 31) // 32).sum().item()}", flush=True)
    extra = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "BUCKET": bucket, "X_FIRST": True},
                           num_warps=w, num_stages=st)
             for bm, bn, bk, w, st in [(16, 64, 256, 8, 3), (16, 64, 256, 8, 2), (16, 64, 128, 8, 3), (16, 64, 128, 8, 4),
                                       (16, 128, 128, 8, 3), (16, 128, 128, 8, 4), (16, 128, 256, 8, 3),
                                       (32, 64, 256, 8, 3), (32, 64, 128, 8, 3), (32, 128, 128, 8, 3),
                                       (16, 32, 256, 2, 3), (16, 32, 128, 2, 4), (16, 32, 256, 4, 3)]]
    for c in all_configs + extra:
        if c.kwargs["BUCKET"] not in (8, 16):
            continue
        kernel.configs = [triton.Config({**c.kwargs, "BUCKET": bucket}, num_warps=c.num_warps, num_stages=c.num_stages,
                                        maxnreg=c.maxnreg)]
        kernel.cache.clear()
        kw = c.kwargs
        label = (f"{kw['BLOCK_M']}/{kw['BLOCK_N']}/{kw['BLOCK_K']} {c.num_warps}w {c.num_stages}s"
                 f"{' xf' if kw['X_FIRST'] else ''}{f' mr{c.maxnreg}' if c.maxnreg else ''}"
                 f"{' small' + str(kw['SMALL_M']) if kw.get('SMALL_M') else ''}"
                 f" (table bucket {kw['BUCKET']})")
        err_gu = ((gu().float() - ref_gu).abs().max() / ref_gu.abs().max()).item()
        err_dn = ((dn().float() - ref_dn).abs().max() / ref_dn.abs().max()).item()
        print(f"  {label:48s} gate/up {graph_us(gu):7.1f}  down {graph_us(dn):7.1f}   "
              f"(vs autotuned: {err_gu:.1e}, {err_dn:.1e})", flush=True)
    kernel.configs = all_configs
    kernel.cache.clear()
    print(f"  autotuned: gate/up {graph_us(gu):7.1f}  down {graph_us(dn):7.1f}")
    for key, c in kernel.cache.items():
        print(f"    {key[:4]} -> {c.kwargs}, {c.num_warps}w {c.num_stages}s mr{c.maxnreg}")
