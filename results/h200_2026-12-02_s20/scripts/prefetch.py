"""L2 prefetch in the Gluon experts kernel: rac.GLUON_PREFETCH_CHUNKS = 0 (main) / 1 / 2 / 4 chunks ahead, the
same forced configuration, alternated, GEMMs alone at 64 and 256 tokens, 5 rounds (min / median us)."""
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
dists = (0, 1, 2, 4)
print("| tokens | GEMM | config | " + " | ".join(f"prefetch {d}" for d in dists) + " | same bits |")
print("| ---: | --- | --- |" + " ---: |" * len(dists) + " --- |")
for T, picks in ((64, (("gate/up", (8, 128, 128, 4, None)), ("gate/up", (8, 64, 128, 4, None)),
                       ("down", (8, 128, 64, 4, None)), ("down", (8, 128, 128, 4, None)))),
                 (256, (("gate/up", (32, 64, 64, 4, None)), ("down", (32, 128, 64, 4, None)),
                        ("down", (32, 128, 64, 4, 128)), ("down", (32, 64, 64, 4, None))))):
    x = rac.quantize_activation_triton(torch.randn(T, D, device="cuda", dtype=bf16))
    h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=bf16))
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    ew = torch.softmax(torch.randn(T, A, device="cuda"), dim=-1).reshape(-1)
    bucket = rac._m_bucket(triton.cdiv(T * A, E), rac.GLUON_CONFIGS)
    for gemm, (t, n, k, w, cap) in picks:
        def call():
            if gemm == "gate/up":
                return rac.grouped_matmul_triton(x, gw, routing.counts, row_ids=routing.token_ids, swiglu=True)
            return rac.grouped_matmul_triton(h, dw, routing.counts, row_weights=ew, row_weight_ids=routing.order)
        kernel.configs = [triton.Config({"BLOCK_T": t, "BLOCK_N": n, "BLOCK_K": k, "NUM_WARPS": w,
                                         "BUCKET": bucket}, num_warps=w, maxnreg=cap)]
        times, outs = {d: [] for d in dists}, {}
        try:
            for d in dists:
                rac.GLUON_PREFETCH_CHUNKS = d
                kernel.cache.clear()
                outs[d] = call()
            for _ in range(5):
                for d in dists:
                    rac.GLUON_PREFETCH_CHUNKS = d
                    kernel.cache.clear()
                    times[d].append(graph_us([call]))
            f = lambda v: f"{min(v):.1f} / {statistics.median(v):.1f}"
            same = all(torch.equal(outs[d], outs[0]) for d in dists)
            label = f"{t}/{n}/{k} {w}w" + (f" maxnreg {cap}" if cap else "")
            print(f"| {T} | {gemm} | {label} | " + " | ".join(f(times[d]) for d in dists) + f" | {same} |",
                  flush=True)
        except Exception as e:
            print(f"| {T} | {gemm} | failed: {type(e).__name__}: {str(e).splitlines()[0][:150]} |", flush=True)
rac.GLUON_PREFETCH_CHUNKS = 2
