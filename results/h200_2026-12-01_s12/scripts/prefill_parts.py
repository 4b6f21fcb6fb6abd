"""Prefill (M = 4096) parts for either tree on PYTHONPATH: quantizer alone, weight decode pass alone, GEMM alone."""
import sys, torch, triton, nvfp4, rac
sys.argv = ["x"]
exec(open("/work/main/.devnext/prefill_ab.py").read().split("torch.manual_seed(0)")[0].split("print(rac.__file__)")[1])
torch.manual_seed(0)
M, bf16 = 4096, torch.bfloat16
old = hasattr(rac, "_gemm_portable")
print(rac.__file__, "old API" if old else "new API")
for name, N, K in [("q", 4096, 2048), ("kv", 512, 2048), ("o", 2048, 4096)]:
    w_q = nvfp4.quantize_weight(torch.randn(N, K, device="cuda", dtype=bf16) * 0.02)
    x = torch.randn(M, K, device="cuda", dtype=bf16)
    if old:
        quant = lambda: rac.quantize_activation_triton(x, None, codes=False, operand=True)
        act = quant()
        gemm = lambda: rac._gemm_portable(act.operand, act.global_scale, w_q, bf16)
    else:
        quant = lambda: rac.quantize_activation_triton(x)
        act = quant()
        gemm = lambda: rac._dense_portable(w_q, bf16, act=act)
    w_data, w_scale = w_q.data.contiguous(), w_q.block_scale.contiguous().view(torch.uint8)
    w_operand = torch.empty(2, N, K // 2, dtype=torch.float16, device="cuda")
    def decode():
        rac._weight_operand_kernel[(triton.cdiv(N, 64), triton.cdiv(K, 256))](
            w_data, w_scale, w_operand, N, K, w_data.stride(0), w_scale.stride(0), w_operand.stride(0),
            GPU=True, ROWS=64, BLOCK_K=256)
    layer = lambda: rac.nvfp4_linear_triton(x, w_q)
    t = {k: graph_us(f) for k, f in [("layer", layer), ("quant", quant), ("decode", decode), ("gemm", gemm)]}
    print(name, " ".join(f"{k} {v:.1f}" for k, v in t.items()), flush=True)
