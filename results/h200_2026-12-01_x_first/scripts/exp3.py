"""X_FIRST (x as the MMA's left operand) vs today's order, grouped and dense; new GEMV configs at M = 1."""
import math, sys, time
import torch, triton
import torch.nn.functional as F
import moe, nvfp4, rac
torch.manual_seed(0)
bf16 = torch.bfloat16
exec(open(".dev19/exp.py").read().split("def force")[0].split("bf16 = torch.bfloat16")[1])
_orig = rac._split_k_buffers
def _big(M, N, bucket, device):
    ws, counters = _orig(M, N, bucket, device)
    return torch.empty(max(ws.numel(), 16 * (M + 256) * (N + 256)), dtype=torch.float32, device=device), counters
rac._split_k_buffers = _big
def close(a, b):
    return f"{((a.float() - b.float()).norm() / b.float().norm()).item():.1e}"
def force(kernel, bucket, entries):
    saved = list(kernel.configs)
    try:
        for bm, bn, bk, w, s, sk, xf in entries:
            kernel.configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "BUCKET": bucket,
                                             "PREFETCH": False, "X_FIRST": xf}, num_warps=w, num_stages=s)]
            kernel.cache.clear()
            yield f"{bm}/{bn}/{bk} sk{sk} {w}w {s}s {'X' if xf else '-'}"
    finally:
        kernel.configs = saved; kernel.cache.clear()
T0 = time.time()
D, E, A, I = 2048, 128, 8, 768
gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02)
down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02)
base = [(16, 32, 256, 4, 3), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3), (32, 64, 128, 4, 3)]
xonly = [(16, 64, 256, 8, 3), (16, 128, 256, 8, 3), (16, 128, 128, 8, 3), (16, 256, 128, 8, 3), (32, 128, 128, 4, 3),
         (32, 64, 256, 4, 3), (16, 64, 128, 4, 4), (16, 32, 512, 4, 3), (16, 64, 512, 4, 2), (32, 128, 256, 8, 3),
         (64, 128, 128, 4, 3), (64, 64, 128, 4, 3), (16, 128, 256, 4, 3)]
entries = [(*c, 1, False) for c in base] + [(*c, 1, True) for c in base + xonly]
for T in (64, 256):
    x = torch.randn(T, D, device="cuda", dtype=bf16)
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    rw = torch.rand(T * A, device="cuda")
    act_x = rac.quantize_activation_triton(x, torch.arange(D // 16, device="cuda") % 2 == 0)
    act_h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=bf16), torch.arange(I // 16, device="cuda") % 2 == 0)
    gu = lambda: rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True)
    dn = lambda: rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=rw)
    ref_g, ref_d = gu(), dn()
    bucket = rac._m_bucket(-(-T * A // E), rac.GROUPED_CONFIGS)
    print(f"\n## experts T={T}: autotuned gate_up {graph_us([gu]):.1f} down {graph_us([dn]):.1f}", flush=True)
    for label in force(rac._grouped_kernel, bucket, entries):
        tg, td = graph_us([gu]), graph_us([dn])
        print(f"{label:28s} gate_up {tg:7.1f}  down {td:7.1f}  err={close(gu(), ref_g)},{close(dn(), ref_d)}", flush=True)
print("elapsed", time.time() - T0, flush=True)
del gate_up_q, down_q
for name, N, K in (("q", 4096, 2048), ("kv", 512, 2048), ("o", 2048, 4096)):
    w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
    wq = nvfp4.quantize_weight(w)
    n4 = max(1, min(64, math.ceil(180e6 / (N * K * 0.5625))))
    wqs = [nvfp4.NVFP4Tensor(wq.data.clone(), wq.block_scale.clone(), wq.global_scale.clone()) for _ in range(n4)]
    for M in (1, 16, 64, 256):
        x = torch.randn(M, K, device="cuda", dtype=bf16)
        mask = torch.arange(K // 16, device="cuda") % 2 == 0
        ref = rac.nvfp4_linear_triton(x, wq, mask)
        ta = graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask) for w in wqs])
        print(f"\n## dense {name} M={M}: autotuned {ta:.1f}", flush=True)
        if M == 1:
            entries = [(1, bn, bk, w_, 1, sk, False) for bn, bk, w_, sk in
                       ((16, 2048, 4, 1), (8, 2048, 4, 1), (16, 2048, 8, 1), (32, 2048, 4, 1), (8, 4096, 4, 1),
                        (16, 4096, 8, 1), (4, 2048, 4, 1), (8, 1024, 4, 2), (16, 1024, 4, 1))]
        elif M == 16:
            entries = [(16, bn, bk, w_, s, sk, True) for bn, bk, w_, s, sk in
                       ((64, 256, 4, 3, 4), (32, 256, 4, 3, 8), (64, 256, 4, 3, 2), (128, 256, 8, 3, 2), (128, 128, 4, 3, 4),
                        (64, 512, 4, 2, 2), (128, 256, 4, 3, 2), (256, 128, 8, 3, 2))]
        elif M == 64:
            entries = [(bm, bn, bk, w_, s, sk, True) for bm, bn, bk, w_, s, sk in
                       ((32, 64, 256, 4, 3, 2), (64, 64, 256, 4, 3, 2), (32, 64, 256, 4, 3, 4), (64, 128, 128, 4, 3, 2),
                        (64, 64, 256, 4, 3, 4), (64, 128, 256, 8, 3, 2), (32, 128, 256, 4, 3, 2), (64, 256, 128, 8, 3, 2))]
        else:
            entries = [(bm, bn, bk, w_, s, sk, True) for bm, bn, bk, w_, s, sk in
                       ((64, 128, 128, 4, 3, 1), (128, 64, 128, 4, 3, 1), (128, 128, 64, 8, 3, 1), (128, 128, 128, 8, 3, 1),
                        (64, 64, 256, 4, 3, 1), (128, 256, 64, 8, 3, 1), (256, 128, 64, 8, 3, 1), (64, 128, 128, 4, 3, 2),
                        (128, 128, 128, 4, 3, 1), (64, 256, 128, 8, 3, 1))]
        bucket = rac._m_bucket(M, rac.DENSE_CONFIGS)
        for label in force(rac._dense_kernel, bucket, entries):
            t = graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask) for w in wqs])
            print(f"{label:28s} {t:7.1f} us err={close(rac.nvfp4_linear_triton(x, wq, mask), ref)}", flush=True)
print("elapsed", time.time() - T0)
