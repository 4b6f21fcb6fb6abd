"""Candidate autotuning configurations forced one at a time (CUDA-graph replays, weights rotated
through HBM): dense layer (incl. quantization, RAC 0.5) at M = 1 / 64 / 256, grouped GEMMs alone at
64 / 256 tokens top-8. Prints one line per (shape, config): median us."""
import math, sys, torch, triton
import nvfp4, rac, moe
from bench import bench_ms

which = sys.argv[1] if len(sys.argv) > 1 else "all"
torch.manual_seed(0)
bf16 = torch.bfloat16


def graph_us(calls):
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                for c in calls:
                    c()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls:
                c()
        return bench_ms(g.replay) * 1e3 / len(calls)
    except Exception as e:
        print("   failed:", type(e).__name__, str(e).splitlines()[0][:120], flush=True)
        return float("nan")


def cfg(bucket, bm, bn, bk, w, s, sk, xf=False, reg=None):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "BUCKET": bucket,
                          "X_FIRST": xf}, num_warps=w, num_stages=s, maxnreg=reg)


def label(c):
    k = c.kwargs
    return (f"{k['BLOCK_M']}/{k['BLOCK_N']}/{k['BLOCK_K']} sk{k['SPLIT_K']} {c.num_warps}w {c.num_stages}s"
            f"{' xf' if k['X_FIRST'] else ''}{f' reg{c.maxnreg}' if c.maxnreg else ''}")


def forced_times(kernel, configs, call):
    out = []
    for c in configs:
        kernel.configs = [c]
        kernel.cache.clear()
        out.append((label(c), graph_us(call)))
    return out


def copies(nbytes):
    return max(1, min(64, math.ceil(180e6 / nbytes)))


DENSE = {
    1: [(1, 16, 512, 4, 1, 4), (1, 16, 1024, 4, 1, 2), (1, 16, 2048, 4, 1, 1), (1, 8, 1024, 4, 1, 2),
        (1, 16, 4096, 8, 1, 1), (1, 16, 2048, 4, 1, 1, False, 168), (1, 16, 2048, 4, 1, 1, False, 128),
        (1, 16, 1024, 4, 1, 2, False, 128), (1, 8, 1024, 4, 1, 2, False, 128), (1, 16, 512, 4, 1, 4, False, 128)],
    64: [(32, 64, 256, 4, 3, 2), (64, 64, 256, 8, 3, 4), (32, 64, 256, 4, 3, 4), (64, 64, 128, 4, 3, 2, True),
         (64, 32, 256, 4, 3, 2, True), (64, 128, 128, 8, 3, 2, True), (64, 64, 256, 4, 3, 2, True)],
    256: [(64, 128, 128, 4, 3, 2, True), (64, 64, 256, 4, 3, 1, True), (128, 64, 128, 4, 3, 1, True),
          (128, 64, 128, 4, 3, 1), (64, 64, 128, 4, 3, 2), (256, 32, 128, 8, 3, 1, True),
          (256, 64, 64, 8, 3, 1, True), (256, 64, 128, 8, 2, 1, True), (256, 32, 256, 8, 2, 1, True),
          (128, 128, 64, 8, 3, 1, True), (128, 64, 128, 8, 3, 2, True), (128, 32, 256, 4, 3, 1, True),
          (256, 64, 64, 8, 4, 1, True)],
}
GROUPED = [(16, 64, 256, 4, 3, 1, True), (16, 128, 128, 4, 3, 1, True), (16, 32, 256, 4, 3, 1, True),
           (16, 64, 128, 4, 4, 1, True), (16, 128, 256, 4, 3, 1, True), (16, 32, 256, 4, 3, 1),
           (32, 64, 128, 4, 3, 1, True), (32, 64, 256, 4, 3, 1, True), (32, 128, 128, 4, 3, 1, True),
           (32, 32, 256, 4, 3, 1, True), (32, 64, 128, 4, 3, 1), (32, 128, 128, 4, 3, 1),
           (64, 64, 128, 4, 3, 1, True), (32, 64, 256, 8, 3, 1, True), (32, 128, 256, 8, 3, 1, True)]

if which.startswith("r2"):  # round 2: registers (occupancy) and more programs
    DENSE = {64: [(32, 64, 256, 4, 3, 2), (32, 32, 256, 4, 3, 2), (32, 64, 128, 4, 3, 2), (16, 64, 256, 4, 3, 2),
                  (32, 64, 256, 4, 3, 2, False, 128), (32, 64, 256, 4, 2, 2), (32, 64, 256, 4, 2, 4),
                  (32, 32, 256, 4, 3, 4), (32, 64, 256, 4, 3, 2, True, 128)],
             256: [(128, 64, 128, 4, 3, 1), (128, 64, 128, 4, 3, 1, False, 128), (64, 64, 128, 4, 3, 2),
                   (64, 64, 128, 4, 3, 2, False, 128), (128, 64, 128, 8, 3, 2, True), (64, 64, 128, 4, 3, 1),
                   (64, 32, 128, 4, 3, 1), (128, 32, 128, 4, 3, 1)]}
    GROUPED = [(16, 64, 256, 4, 3, 1, True), (16, 64, 256, 4, 3, 1, True, 128), (16, 64, 256, 4, 3, 1, True, 112),
               (16, 64, 256, 4, 3, 1, True, 96), (16, 64, 256, 4, 2, 1, True, 128), (16, 64, 128, 4, 3, 1, True, 128),
               (16, 64, 128, 4, 4, 1, True, 96), (16, 128, 128, 4, 3, 1, True), (16, 128, 128, 4, 3, 1, True, 96),
               (16, 128, 128, 4, 3, 1, True, 112), (16, 32, 256, 4, 3, 1, True, 96), (16, 64, 256, 8, 3, 1, True, 96),
               (32, 64, 128, 4, 3, 1, False, 128), (32, 64, 128, 4, 3, 1, True, 128)]
    which = which[2:] or "all"
D, H_Q, H_KV, E, A, I = 2048, 4096, 512, 128, 8, 768
if which in ("all", "dense"):
    qkv = (H_Q, H_KV, H_KV)
    for name, N, K, splits in (("q", H_Q, D, None), ("kv", H_KV, D, None), ("o", D, H_Q, None),
                               ("qkv", sum(qkv), D, qkv)):
        w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
        if splits:
            wq = rac.stack_weights([nvfp4.quantize_weight(p) for p in w.split(splits)])
        else:
            wq = nvfp4.quantize_weight(w)
        wqs = [nvfp4.NVFP4Tensor(wq.data.clone(), wq.block_scale.clone(), wq.global_scale.clone())
               for _ in range(copies(N * K * 0.5625))]
        ws = [w.clone() for _ in range(copies(2 * N * K))]
        mask = torch.arange(K // 16, device="cuda") % 2 == 0
        for M, entries in DENSE.items():
            x = torch.randn(M, K, device="cuda", dtype=bf16)
            b = graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
            configs = [cfg(M, *e) for e in entries]
            call = [lambda w=w: rac.nvfp4_linear_triton(x, w, mask, splits=splits) for w in wqs]
            res = forced_times(rac._dense_kernel, configs, call)
            print(f"dense {name} {N}x{K} M={M} bf16 {b:.1f} | " +
                  "; ".join(f"{l}: {t:.1f}" for l, t in res), flush=True)

if which in ("all", "grouped"):
    gate_up = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02)
    down = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02)
    for T in (64, 256):
        x = torch.randn(T, D, device="cuda", dtype=bf16)
        ids = torch.rand(T, E, device="cuda").topk(A, dim=-1).indices
        routing = moe.route_tokens(ids, E)
        rw = torch.rand(T * A, device="cuda")
        bucket = rac._m_bucket(-(-T * A // E), rac.GROUPED_CONFIGS)
        mx = int(routing.counts.max())
        mask_x = torch.arange(D // 16, device="cuda") % 2 == 0
        mask_h = torch.arange(I // 16, device="cuda") % 2 == 0
        act_x = rac.quantize_activation_triton(x, mask_x)
        act_h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=bf16), mask_h)
        configs = [cfg(bucket, *e) for e in GROUPED]
        for name, call in (
                ("gate_up", [lambda: rac.grouped_matmul_triton(act_x, gate_up, routing.counts,
                                                               row_ids=routing.token_ids, swiglu=True)]),
                ("down", [lambda: rac.grouped_matmul_triton(act_h, down, routing.counts, row_weights=rw)])):
            res = forced_times(rac._grouped_kernel, configs, call)
            print(f"grouped {name} T={T} max rows/expert {mx} | " +
                  "; ".join(f"{l}: {t:.1f}" for l, t in res), flush=True)
