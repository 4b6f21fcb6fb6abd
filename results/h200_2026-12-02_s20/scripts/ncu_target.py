"""One launch each of the experts' Gluon GEMMs at 256 tokens (forced configuration), between profiler
start/stop, for ncu --profile-from-start off."""
import sys, torch, triton
import moe, nvfp4, rac
torch.manual_seed(0)
E, D, I, A, T = 128, 2048, 768, 8, 256
bf16 = torch.bfloat16
gw = rac.chunk_experts(nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02))
dw = rac.chunk_experts(nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02))
x = rac.quantize_activation_triton(torch.randn(T, D, device="cuda", dtype=bf16))
h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=bf16))
routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
ew = torch.softmax(torch.randn(T, A, device="cuda"), dim=-1).reshape(-1)
bucket = rac._m_bucket(triton.cdiv(T * A, E), rac.GLUON_CONFIGS)
runs = [("gate/up", (32, 64, 64, 4, None)), ("gate/up", (32, 64, 64, 4, 80)), ("down", (32, 128, 64, 4, None)),
        ("down", (32, 64, 64, 4, 80))]
fns = []
for gemm, (t, n, k, w, cap) in runs:
    kernel = rac._grouped_gluon_kernel
    config = triton.Config({"BLOCK_T": t, "BLOCK_N": n, "BLOCK_K": k, "NUM_WARPS": w, "BUCKET": bucket},
                           num_warps=w, maxnreg=cap)
    def call(gemm=gemm, config=config):
        kernel.configs = [config]
        kernel.cache.clear()
        if gemm == "gate/up":
            return rac.grouped_matmul_triton(x, gw, routing.counts, row_ids=routing.token_ids, swiglu=True)
        return rac.grouped_matmul_triton(h, dw, routing.counts, row_weights=ew, row_weight_ids=routing.order)
    call(); call()  # compile, warm
    fns.append(call)
torch.cuda.synchronize()
torch.cuda.profiler.start()
for gemm_run, call in zip(runs, fns):
    call()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("profiled", runs)
