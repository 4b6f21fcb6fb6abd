"""Register caps on main's Gluon experts kernel: the same tile with maxnreg None / 96 / 80, alternated, GEMMs
alone, 7 rounds; min and median us."""
import sys, statistics, torch, triton
sys.path.insert(0, ".devnext/s20")
import moe, nvfp4, rac
from gemv_gpu_common import graph_us
torch.manual_seed(0)
E, D, I, A = 128, 2048, 768, 8
bf16 = torch.bfloat16
gw = rac.chunk_experts(nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02))
dw = rac.chunk_experts(nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02))
kernel = rac._grouped_gluon_kernel
print("| tokens | GEMM | tile | no cap | maxnreg 96 | maxnreg 80 | same bits |")
print("| ---: | --- | --- | ---: | ---: | ---: | --- |")
for T, picks in ((64, (("gate/up", (8, 128, 128, 4)), ("gate/up", (8, 64, 128, 4)), ("down", (8, 128, 64, 4)),
                       ("down", (8, 128, 128, 4)))),
                 (256, (("gate/up", (32, 64, 64, 4)), ("gate/up", (32, 128, 64, 4)), ("down", (32, 128, 64, 4)),
                        ("down", (32, 64, 64, 4))))):
    x = rac.quantize_activation_triton(torch.randn(T, D, device="cuda", dtype=bf16))
    h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=bf16))
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    ew = torch.softmax(torch.randn(T, A, device="cuda"), dim=-1).reshape(-1)
    bucket = rac._m_bucket(triton.cdiv(T * A, E), rac.GLUON_CONFIGS)
    for gemm, (t, n, k, w) in picks:
        def call():
            if gemm == "gate/up":
                return rac.grouped_matmul_triton(x, gw, routing.counts, row_ids=routing.token_ids, swiglu=True)
            return rac.grouped_matmul_triton(h, dw, routing.counts, row_weights=ew, row_weight_ids=routing.order)
        caps, times, outs, graphs = (None, 96, 80), {}, {}, {}
        for cap in caps:
            kernel.configs = [triton.Config({"BLOCK_T": t, "BLOCK_N": n, "BLOCK_K": k, "NUM_WARPS": w,
                                             "BUCKET": bucket}, num_warps=w, maxnreg=cap)]
            kernel.cache.clear()
            outs[cap] = call()
            times[cap] = []
        for _ in range(5):
            for cap in caps:
                kernel.configs = [triton.Config({"BLOCK_T": t, "BLOCK_N": n, "BLOCK_K": k, "NUM_WARPS": w,
                                                 "BUCKET": bucket}, num_warps=w, maxnreg=cap)]
                kernel.cache.clear()
                times[cap].append(graph_us([call]))
        f = lambda v: f"{min(v):.1f} / {statistics.median(v):.1f}"
        same = all(torch.equal(outs[c], outs[None]) for c in caps)
        print(f"| {T} | {gemm} | {t}/{n}/{k} {w}w | {f(times[None])} | {f(times[96])} | {f(times[80])} | {same} |",
              flush=True)
