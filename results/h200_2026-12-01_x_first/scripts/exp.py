"""Forced-config timings of rac.py's kernels (decode shapes), PREFETCH on/off. CUDA-graph replays, weights rotated."""
import math, sys, time
import torch, triton
import torch.nn.functional as F
import moe, nvfp4, rac

torch.manual_seed(0)
bf16 = torch.bfloat16
def bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
def graph_us(calls):
    try:
        side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                for c in calls: c()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls: c()
        return bench_ms(g.replay) * 1e3 / len(calls)
    except Exception as e:
        print("  failed:", type(e).__name__, str(e).splitlines()[0][:200]); return float("nan")

def force(kernel, bucket, entries):
    saved = list(kernel.configs)
    try:
        for bm, bn, bk, w, s, sk, p in entries:
            kernel.configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk,
                                             "BUCKET": bucket, "PREFETCH": p}, num_warps=w, num_stages=s)]
            kernel.cache.clear()
            yield f"{bm}/{bn}/{bk} sk{sk} {w}w {s}s {'P' if p else '-'}"
    finally:
        kernel.configs = saved; kernel.cache.clear()

_orig = rac._split_k_buffers
def _big(M, N, bucket, device):
    ws, counters = _orig(M, N, bucket, device)
    return torch.empty(max(ws.numel(), 16 * (M + 256) * (N + 256)), dtype=torch.float32, device=device), counters
rac._split_k_buffers = _big
def close(a, b):
    return f"{((a.float() - b.float()).norm() / b.float().norm()).item():.1e}"
which = sys.argv[1:] or ["experts", "dense"]
T0 = time.time()
if "experts" in which:
    D, E, A, I = 2048, 128, 8, 768
    gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02)
    down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02)
    entries = []
    for p in (False, True):
        for bn, bk, w, s in ((64, 256, 4, 3), (32, 256, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3), (32, 512, 4, 2),
                             (64, 512, 8, 2), (128, 256, 8, 2), (64, 256, 4, 1), (32, 256, 4, 1), (64, 256, 8, 3),
                             (128, 128, 8, 3), (32, 128, 4, 3)):
            entries.append((16, bn, bk, w, s, 1, p))
    for T in (64, 256):
        x = torch.randn(T, D, device="cuda", dtype=bf16)
        ids = torch.rand(T, E, device="cuda").topk(A, dim=-1).indices
        routing = moe.route_tokens(ids, E)
        hit = int((routing.counts > 0).sum())
        rw = torch.rand(T * A, device="cuda")
        act_x = rac.quantize_activation_triton(x, torch.arange(D // 16, device="cuda") % 2 == 0)
        act_h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=bf16),
                                               torch.arange(I // 16, device="cuda") % 2 == 0)
        ref_g = rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True)
        ref_d = rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=rw)
        bucket = rac._m_bucket(-(-T * A // E), rac.GROUPED_CONFIGS)
        floor_g = hit * 2 * I * D * (0.5 + 1 / 16) / 4.24e12 * 1e6
        floor_d = hit * D * I * (0.5 + 1 / 16) / 4.24e12 * 1e6
        print(f"\n## experts T={T} hit={hit} floors gate_up {floor_g:.1f} down {floor_d:.1f} us; autotuned:",
              f"{graph_us([lambda: rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True)]):.1f}",
              f"{graph_us([lambda: rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=rw)]):.1f}", flush=True)
        for label in force(rac._grouped_kernel, bucket, entries):
            tg = graph_us([lambda: rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True)])
            g = rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True)
            td = graph_us([lambda: rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=rw)])
            d = rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=rw)
            same = close(g, ref_g) + ',' + close(d, ref_d)
            print(f"{label:28s} gate_up {tg:7.1f} ({100*floor_g/tg:3.0f}%)  down {td:7.1f} ({100*floor_d/td:3.0f}%)  err={same}", flush=True)
    del gate_up_q, down_q
    print("elapsed", time.time() - T0)

if "dense" in which:
    for name, N, K in (("q", 4096, 2048), ("kv", 512, 2048), ("o", 2048, 4096)):
        w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
        wq = nvfp4.quantize_weight(w)
        n = max(1, min(64, math.ceil(180e6 / (2 * N * K))))
        n4 = max(1, min(64, math.ceil(180e6 / (N * K * 0.5625))))
        ws = [w.clone() for _ in range(n)]
        wqs = [nvfp4.NVFP4Tensor(wq.data.clone(), wq.block_scale.clone(), wq.global_scale.clone()) for _ in range(n4)]
        for M in (1, 16, 64, 256):
            x = torch.randn(M, K, device="cuda", dtype=bf16)
            mask = torch.arange(K // 16, device="cuda") % 2 == 0
            ref = rac.nvfp4_linear_triton(x, wq, mask)
            tb = graph_us([lambda w=w: F.linear(x, w) for w in ws])
            ta = graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask) for w in wqs])
            print(f"\n## dense {name} {N}x{K} M={M}: bf16 {tb:.1f} us, autotuned rac0.5 {ta:.1f} us", flush=True)
            if M == 1:
                entries = [(1, bn, bk, w_, 1, sk, p) for p in (False, True) for bn, bk, w_, sk in
                           ((16, 512, 4, 4), (32, 512, 4, 4), (16, 1024, 4, 2), (16, 2048, 4, 1), (32, 2048, 8, 1),
                            (16, 256, 4, 8), (8, 512, 4, 4), (64, 512, 8, 4), (32, 256, 4, 8), (8, 2048, 4, 1),
                            (16, 512, 4, 2), (32, 1024, 8, 2))]
            elif M == 16:
                entries = [(16, bn, bk, w_, s, sk, p) for p in (False, True) for bn, bk, w_, s, sk in
                           ((64, 256, 4, 3, 4), (32, 256, 4, 3, 8), (64, 256, 4, 3, 2), (128, 256, 8, 3, 2),
                            (64, 512, 4, 2, 2), (32, 512, 4, 2, 4), (64, 256, 4, 1, 4), (128, 128, 4, 3, 4))]
            elif M == 64:
                entries = [(bm, bn, bk, w_, s, sk, p) for p in (False, True) for bm, bn, bk, w_, s, sk in
                           ((32, 64, 256, 4, 3, 2), (64, 64, 256, 8, 3, 4), (32, 64, 256, 4, 3, 4), (64, 64, 256, 4, 3, 2),
                            (64, 128, 128, 8, 3, 2), (32, 128, 256, 8, 3, 2), (64, 32, 256, 4, 3, 4))]
            else:
                entries = [(bm, bn, bk, w_, s, sk, p) for p in (False, True) for bm, bn, bk, w_, s, sk in
                           ((64, 128, 128, 4, 3, 1), (128, 64, 128, 4, 3, 1), (128, 128, 64, 8, 3, 1), (128, 64, 128, 8, 3, 1),
                            (256, 64, 128, 8, 3, 1), (128, 128, 128, 8, 3, 1), (64, 64, 256, 4, 3, 1), (128, 64, 256, 8, 2, 1),
                            (64, 128, 128, 4, 3, 2), (128, 64, 128, 8, 3, 2))]
            bucket = rac._m_bucket(M, rac.DENSE_CONFIGS)
            for label in force(rac._dense_kernel, bucket, entries):
                t = graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask) for w in wqs])
                same = close(rac.nvfp4_linear_triton(x, wq, mask), ref)
                print(f"{label:28s} {t:7.1f} us  ({tb / t:.2f}x bf16) err={same}", flush=True)
    print("elapsed", time.time() - T0)
