"""Experts' grouped GEMMs with one stage dropped (a rac.py variant on PYTHONPATH): gate/up and down alone, CUDA-graph
replays, at the table's picks (gate/up 16/64/256 4w 2s mr128, down 16/128/128 4w 3s)."""
import sys, torch, triton, moe, nvfp4, rac
sys.path.insert(0, "/work/main/.devnext")
print(rac.__file__)
exec(open("/work/main/.devnext/experts_regs.py").read().split("torch.manual_seed(0)")[0].split("import sys, torch, triton, moe, nvfp4, rac")[1])
torch.manual_seed(0)
E, D, I, A = 128, 2048, 768, 8
gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02)
down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02)
kernel = rac._grouped_kernel
cfg = lambda bn, bk, w, s, mr: triton.Config({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "BUCKET": 16,
                                              "X_FIRST": True}, num_warps=w, num_stages=s, maxnreg=mr)
for T in (64, 256):
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    act_x = rac.quantize_activation_triton(x, torch.arange(D // 16, device="cuda") % 2 == 0)
    act_h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=torch.bfloat16),
                                           torch.arange(I // 16, device="cuda") % 2 == 0)
    row_weights = torch.rand(T * A, device="cuda")
    gu = lambda: rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True)
    dn = lambda: rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=row_weights)
    kernel.configs = [cfg(64, 256, 4, 2, 128)]; kernel.cache.clear()
    t_gu = graph_us(gu)
    kernel.configs = [cfg(128, 128, 4, 3, None)]; kernel.cache.clear()
    t_dn = graph_us(dn)
    print(f"T={T}: gate/up {t_gu:7.1f}  down {t_dn:7.1f}", flush=True)
