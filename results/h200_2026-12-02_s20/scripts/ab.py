"""A/B, alternated: main's Gluon experts kernel (95f4a8f) and the unmasked-loads one, the same forced
configuration on the same inputs, GEMMs alone, 7 rounds; min and median us."""
import sys, statistics, torch, triton
sys.path.insert(0, ".devnext/s20")
import bench, moe, nvfp4, rac, rac_main
from gemv_gpu_common import graph_us
torch.manual_seed(0)
E, D, I, A = 128, 2048, 768, 8
bf16 = torch.bfloat16
gq = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02)
dq = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02)
weights = {m: (m.chunk_experts(gq), m.chunk_experts(dq)) for m in (rac_main, rac)}
print("| tokens | GEMM | config | main min / median | unmasked min / median | same bits |")
print("| ---: | --- | --- | ---: | ---: | --- |")
for T, picks in ((64, (("gate/up", (8, 128, 128, 4)), ("gate/up", (8, 64, 128, 4)), ("down", (8, 128, 64, 4)),
                       ("down", (8, 128, 128, 4)))),
                 (256, (("gate/up", (32, 64, 64, 4)), ("down", (32, 128, 64, 4))))):
    x = torch.randn(T, D, device="cuda", dtype=bf16)
    h = torch.randn(T * A, I, device="cuda", dtype=bf16)
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    ew = torch.softmax(torch.randn(T, A, device="cuda"), dim=-1).reshape(-1)
    bucket = rac._m_bucket(triton.cdiv(T * A, E), rac.GLUON_CONFIGS)
    for gemm, (t, n, k, w) in picks:
        calls, outs = {}, {}
        for m in (rac_main, rac):
            gw, dw = weights[m]
            act = m.quantize_activation_triton(x if gemm == "gate/up" else h)
            call = ((lambda m=m, act=act, gw=gw: m.grouped_matmul_triton(act, gw, routing.counts,
                                                                          row_ids=routing.token_ids, swiglu=True))
                    if gemm == "gate/up" else
                    (lambda m=m, act=act, dw=dw: m.grouped_matmul_triton(act, dw, routing.counts, row_weights=ew,
                                                                          row_weight_ids=routing.order)))
            m._grouped_gluon_kernel.configs = [triton.Config({"BLOCK_T": t, "BLOCK_N": n, "BLOCK_K": k,
                                                              "NUM_WARPS": w, "BUCKET": bucket}, num_warps=w)]
            m._grouped_gluon_kernel.cache.clear()
            outs[m] = call()
            calls[m] = call
        times = {m: [] for m in calls}
        for _ in range(7):
            for m in (rac_main, rac):
                times[m].append(graph_us([calls[m]]))
        f = lambda v: f"{min(v):.1f} / {statistics.median(v):.1f}"
        print(f"| {T} | {gemm} | {t}/{n}/{k} {w}w | {f(times[rac_main])} | {f(times[rac])} | "
              f"{torch.equal(outs[rac_main], outs[rac])} |", flush=True)
