"""GPU: the Gluon dense decode prototype against the twin and rac's fused GEMV; CUDA-graph time, weights rotated."""
import math, os, sys, itertools
sys.path.insert(0, os.path.dirname(__file__))
import torch, torch.nn.functional as F
import nvfp4, rac
import gd
torch.manual_seed(0)
bf16 = torch.bfloat16

def bench_us(calls, reps=200):
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for c in calls: c()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls: c()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(15):
        t0 = torch.cuda.Event(enable_timing=True); t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(10): g.replay()
        t1.record(); torch.cuda.synchronize()
        ts.append(t0.elapsed_time(t1) * 1e3 / 10 / len(calls))
    ts.sort(); return ts[len(ts) // 2]

def int4_weight(w):
    N, K = w.shape
    groups = w.float().view(N, K // 128, 128)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-6)
    q = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).view(N, K)
    packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    zero = low + 8 * scale
    sz = torch.stack((scale, zero), dim=-1).view(N, K // 128, 2).transpose(0, 1).contiguous()
    return packed, sz.to(bf16)

CFGS = [(64, 256, 1, 4, 0), (64, 256, 1, 4, 1), (64, 128, 2, 4, 1), (64, 512, 1, 4, 1), (64, 128, 1, 4, 1),
        (32, 256, 1, 2, 1), (32, 128, 1, 2, 1), (128, 256, 1, 4, 1), (64, 1024, 1, 4, 1), (64, 512, 2, 4, 1),
        (16, 256, 1, 1, 1), (16, 512, 1, 1, 1), (32, 512, 1, 2, 1), (128, 512, 1, 4, 1), (128, 128, 1, 4, 1)]
shapes = [("q_proj", 4096, 2048, None), ("k/v_proj", 512, 2048, None), ("o_proj", 2048, 4096, None),
          ("qkv stacked", 5120, 2048, (4096, 512, 512))]
for name, N, K, splits in shapes:
    w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
    w_q = (rac.stack_weights([nvfp4.quantize_weight(p) for p in w.split(splits)]) if splits
           else nvfp4.quantize_weight(w))
    x = torch.randn(1, K, device="cuda", dtype=bf16)
    mask = (torch.arange(K // 16, device="cuda") % 2 == 0)
    ref = rac.nvfp4_linear_reference(x, w_q, mask) if not splits else None
    cur = rac.nvfp4_linear_triton(x, w_q, mask, splits=splits)
    cur = torch.cat([c.reshape(-1) for c in cur]) if splits else cur.reshape(-1)
    nbytes = N * K * (0.5 + 1 / 16)
    ncopy = max(1, min(64, math.ceil(180e6 / nbytes)))
    wqs = [nvfp4.NVFP4Tensor(w_q.data.clone(), w_q.block_scale.clone(), w_q.global_scale.clone()) for _ in range(ncopy)]
    wbs = [w.clone() for _ in range(max(1, min(64, math.ceil(180e6 / (2 * N * K)))))]
    i4 = int4_weight(w); i4s = [tuple(t.clone() for t in i4) for _ in range(ncopy)]
    t_bf = bench_us([lambda w=w_: F.linear(x, w) for w_ in wbs])
    t_i4 = bench_us([lambda p=p: torch._weight_int4pack_mm(x, p[0], 128, p[1]) for p in i4s])
    t_cur = bench_us([lambda wq=wq: rac.nvfp4_linear_triton(x, wq, mask, splits=splits) for wq in wqs])
    print(f"{name} M=1: bf16 {t_bf:.1f} int4 {t_i4:.1f} rac-now {t_cur:.1f} us", flush=True)
    for cfg in CFGS:
        bn, bk, st, nw, lf = cfg
        if K % (bk * st) or N % bn and not splits:
            continue
        kw = dict(BLOCK_N=bn, BLOCK_K=bk, STEPS=st, num_warps=nw, LOAD_FIRST=bool(lf))
        try:
            for pdl in (False, True):
                out = gd.dense_gluon(x, w_q, mask, splits=splits, pdl=pdl, **kw)
                out = torch.cat([c.reshape(-1) for c in out]) if splits else out.reshape(-1)
                d_cur = ((out.float() - cur.float()).abs().max() / cur.float().abs().max()).item()
                d_ref = (((out.float() - ref.reshape(-1).float()).abs().max() / ref.float().abs().max()).item()
                         if ref is not None else float("nan"))
                rep = [gd.dense_gluon(x, w_q, mask, splits=splits, pdl=pdl, **kw) for _ in range(3)]
                same = all(torch.equal(torch.cat([c.reshape(-1) for c in r]) if splits else r.reshape(-1), out) for r in rep)
                t = bench_us([lambda wq=wq: gd.dense_gluon(x, wq, mask, splits=splits, pdl=pdl, **kw) for wq in wqs])
                print(f"  {cfg} pdl={int(pdl)}: {t:.1f} us  ({t_bf / t:.2f}x bf16, {t_i4 / t:.2f}x int4)  "
                      f"vs rac {d_cur:.1e} vs twin {d_ref:.1e} repeat-equal {same}", flush=True)
        except Exception as e:
            print(f"  {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
