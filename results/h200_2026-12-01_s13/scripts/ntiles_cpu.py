import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch, triton, moe, nvfp4, rac
torch.manual_seed(0)
E, D, I = 5, 64, 48
counts_wanted = [0, 7, 16, 17, 31]
ids = torch.cat([torch.full((n,), e) for e, n in enumerate(counts_wanted)])
ids = ids[torch.randperm(ids.numel())][:, None]
routing = moe.route_tokens(ids, E)
x = torch.randn(ids.shape[0], D, dtype=torch.bfloat16)
mask = torch.arange(D // 16) % 2 == 0
gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D))
down_q = nvfp4.quantize_weight(torch.randn(E, D, I))
act = rac.quantize_activation_triton(x, mask, codes=True)
h = rac.quantize_activation_triton(torch.randn(ids.shape[0], I, dtype=torch.bfloat16), mask[:3], codes=True)
rw = torch.rand(ids.shape[0])
k = rac._grouped_kernel
saved = list(k.configs)
for nt, bm in ((1, 16), (2, 16), (3, 16), (4, 32)):
    k.configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 1, "BUCKET": b,
                                "X_FIRST": True, "N_TILES": nt}, num_warps=4, num_stages=1)
                 for b in (16, 64, 256, 4096)]
    k.cache.clear()
    y = rac.grouped_matmul_triton(act, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True,
                                  out_dtype=torch.float32)
    ref = rac.grouped_matmul_reference(act.x_q, gate_up_q, routing.counts, act.residual, row_ids=routing.token_ids,
                                       swiglu=True, out_dtype=torch.float32)
    y2 = rac.grouped_matmul_triton(h, down_q, routing.counts, row_weights=rw, out_dtype=torch.float32)
    ref2 = rac.grouped_matmul_reference(h.x_q, down_q, routing.counts, h.residual, row_weights=rw, out_dtype=torch.float32)
    print(nt, bm, (y - ref).abs().max().item() / ref.abs().max().item(),
          (y2 - ref2).abs().max().item() / ref2.abs().max().item(), y.isnan().any().item())
