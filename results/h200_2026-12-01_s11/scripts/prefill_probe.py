"""Prefill (M = 4096) cost parts on the H200: the W4A4 layer as it is, its quantizer alone, the weight decode
pass alone, and a cuBLAS fp16 GEMM with fp32 output (torch.mm out_dtype) plus a scale-and-cast epilogue."""
import torch, triton, nvfp4, rac
import torch.nn.functional as F

def graph_us(fn, n=10, reps=20):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / n)
    return sorted(ts)[len(ts) // 2]

torch.manual_seed(0)
M = 4096
bf16 = torch.bfloat16
try:
    a = torch.randn(64, 64, device="cuda", dtype=torch.float16); print("mm out_dtype:", torch.mm(a, a, out_dtype=torch.float32).dtype)
except Exception as e:
    print("mm out_dtype failed:", type(e).__name__, str(e)[:200])
for name, N, K in [("q", 4096, 2048), ("kv", 512, 2048), ("o", 2048, 4096)]:
    w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
    w_q = nvfp4.quantize_weight(w)
    x = torch.randn(M, K, device="cuda", dtype=bf16)
    mask = torch.arange(K // 16, device="cuda") % 2 == 0
    t = {}
    t["bf16"] = graph_us(lambda: F.linear(x, w))
    t["layer"] = graph_us(lambda: rac.nvfp4_linear_triton(x, w_q))
    t["layer_rac"] = graph_us(lambda: rac.nvfp4_linear_triton(x, w_q, mask))
    t["quantizer"] = graph_us(lambda: rac.quantize_activation_triton(x))
    t["quantizer_rac"] = graph_us(lambda: rac.quantize_activation_triton(x, mask))
    w_data, w_scale = w_q.data.contiguous(), w_q.block_scale.contiguous().view(torch.uint8)
    w_operand = torch.empty(2, N, K // 2, dtype=torch.float16, device="cuda")
    def decode():
        rac._weight_operand_kernel[(triton.cdiv(N, 64), triton.cdiv(K, 256))](
            w_data, w_scale, w_operand, N, K, w_data.stride(0), w_scale.stride(0), w_operand.stride(0),
            GPU=True, ROWS=64, BLOCK_K=256)
    t["weight_decode"] = graph_us(decode)
    act = rac.quantize_activation_triton(x)
    t["gemm_alone"] = graph_us(lambda: rac._dense_portable(w_q, bf16, act=act))
    x16 = torch.randn(M, K, device="cuda", dtype=torch.float16)
    w16 = torch.randn(N, K, device="cuda", dtype=torch.float16)
    try:
        t["cublas_fp16_fp32out"] = graph_us(lambda: torch.mm(x16, w16.t(), out_dtype=torch.float32))
        y32 = torch.mm(x16, w16.t(), out_dtype=torch.float32)
        s = torch.tensor(1.5, device="cuda")
        t["epilogue_torch"] = graph_us(lambda: (y32 * s).to(bf16))
    except Exception as e:
        print("cublas path failed:", e)
    t["cublas_fp16_fp16out"] = graph_us(lambda: torch.mm(x16, w16.t()))
    print(name, N, K, " ".join(f"{k} {v:.1f}" for k, v in t.items()), flush=True)
