"""The unmasked Gluon experts kernel under compute-sanitizer memcheck: short tiles, a short last N tile, the
last expert holding tokens (its clamped rows are the last rows of the buffers)."""
import torch, triton
import os, sys, importlib
sys.path.insert(0, ".devnext/s20")
import moe, nvfp4
rac = importlib.import_module(os.environ.get("RAC", "rac"))
print("module", rac.__name__)
torch.manual_seed(0)
E, D, I, N_DOWN, tokens, A = 4, 256, 80, 208, 13, 2
ids = torch.stack([torch.full((tokens,), E - 1), torch.arange(tokens) % (E - 1)], 1).cuda()
routing = moe.route_tokens(ids, E)
x = rac.quantize_activation_triton(torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16), codes=True)
h = rac.quantize_activation_triton(torch.randn(tokens * A, 128, device="cuda", dtype=torch.bfloat16), codes=True)
gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda"))
down_q = nvfp4.quantize_weight(torch.randn(E, N_DOWN, 128, device="cuda"))
gw, dw = rac.chunk_experts(gate_up_q), rac.chunk_experts(down_q)
rw = torch.rand(tokens * A, device="cuda")
assert rac._gluon_experts(torch.device("cuda"))
bucket = rac._m_bucket(triton.cdiv(tokens * A, E), rac.GLUON_CONFIGS)
saved = list(rac._grouped_gluon_kernel.configs)
for c in saved:
    rac._grouped_gluon_kernel.configs = [triton.Config({**c.kwargs, "BUCKET": bucket}, num_warps=c.num_warps)]
    rac._grouped_gluon_kernel.cache.clear()
    y1 = rac.grouped_matmul_triton(x, gw, routing.counts, row_ids=routing.token_ids, swiglu=True,
                                   out_dtype=torch.float32)
    y2 = rac.grouped_matmul_triton(h, dw, routing.counts, row_weights=rw, out_dtype=torch.float32)
    torch.cuda.synchronize()
    r1 = rac.grouped_matmul_reference(x.x_q, gate_up_q, routing.counts, x.residual, row_ids=routing.token_ids,
                                      swiglu=True, out_dtype=torch.float32)
    r2 = rac.grouped_matmul_reference(h.x_q, down_q, routing.counts, row_weights=rw, out_dtype=torch.float32)
    e1 = ((y1 - r1).abs().max() / r1.abs().max()).item(); e2 = ((y2 - r2).abs().max() / r2.abs().max()).item()
    print(c.kwargs["BLOCK_T"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, f"{e1:.1e} {e2:.1e}",
          flush=True)
print("done")
