"""Kernels for ncu: warm up (autotune), then profile one call of each between cudaProfilerStart/Stop."""
import torch, moe, nvfp4, rac
torch.manual_seed(0)
bf16 = torch.bfloat16
D, E, A, I = 2048, 128, 8, 768
gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02)
down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02)
T = 64
x = torch.randn(T, D, device="cuda", dtype=bf16)
routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
act_x = rac.quantize_activation_triton(x)
act_h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=bf16))
wq = nvfp4.quantize_weight(torch.randn(4096, 2048, device="cuda", dtype=bf16) * 0.02)
mask = torch.arange(128, device="cuda") % 2 == 0
xs = {M: torch.randn(M, 2048, device="cuda", dtype=bf16) for M in (1, 64, 256)}
calls = [lambda: rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True),
         lambda: rac.grouped_matmul_triton(act_h, down_q, routing.counts),
         lambda: rac.nvfp4_linear_triton(xs[1], wq, mask)]
acts = {M: rac.quantize_activation_triton(xs[M], mask) for M in (64, 256)}
calls += [lambda M=M: rac._dense_portable(wq, bf16, act=acts[M]) for M in (64, 256)]
for _ in range(3):
    for c in calls: c()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for c in calls: c()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
