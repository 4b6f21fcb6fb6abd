"""One forced configuration of a rac kernel, called 4 times (3 warm-up + 1 profiled under ncu)."""
import sys, torch, triton
import nvfp4, rac, moe
which = sys.argv[1]
torch.manual_seed(0)
bf16 = torch.bfloat16
D, H_Q, E, A, I = 2048, 4096, 128, 8, 768
def cfg(bucket, bm, bn, bk, w, s, sk, xf=False):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "BUCKET": bucket,
                          "X_FIRST": xf}, num_warps=w, num_stages=s)
if which.startswith("grouped"):
    T = 256
    x = torch.randn(T, D, device="cuda", dtype=bf16)
    ids = torch.rand(T, E, device="cuda").topk(A, dim=-1).indices
    routing = moe.route_tokens(ids, E)
    if which == "grouped_gu":
        w = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02)
        act = rac.quantize_activation_triton(x, torch.arange(D // 16, device="cuda") % 2 == 0)
        rac._grouped_kernel.configs = [cfg(16, 16, 64, 256, 4, 3, 1, True)]
        call = lambda: rac.grouped_matmul_triton(act, w, routing.counts, row_ids=routing.token_ids, swiglu=True)
    else:
        w = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02)
        act = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=bf16),
                                             torch.arange(I // 16, device="cuda") % 2 == 0)
        rac._grouped_kernel.configs = [cfg(16, 16, 128, 128, 4, 3, 1, True)]
        call = lambda: rac.grouped_matmul_triton(act, w, routing.counts, row_weights=torch.rand(T * A, device="cuda"))
else:
    M = 64
    w = nvfp4.quantize_weight(torch.randn(H_Q, D, device="cuda", dtype=bf16) * 0.02)
    x = torch.randn(M, D, device="cuda", dtype=bf16)
    act = rac.quantize_activation_triton(x, torch.arange(D // 16, device="cuda") % 2 == 0)
    rac._dense_kernel.configs = [cfg(64, 32, 64, 256, 4, 3, 2)]
    call = lambda: rac._dense_portable(w, bf16, act=act)
for _ in range(4):
    call()
torch.cuda.synchronize()
print("done", which)
