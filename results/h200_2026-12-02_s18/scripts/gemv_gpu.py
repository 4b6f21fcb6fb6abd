"""GPU: the full-K GEMV prototype (gemv.py) against rac's layer, BF16 and int4 at M = 1: equality, timing."""
import sys, math, itertools, torch
sys.path.insert(0, ".devnext/s18")
import torch.nn.functional as F
import rac, nvfp4, bench, gemv as G
print(bench.gpu_header(), flush=True)
bf16 = torch.bfloat16
torch.manual_seed(0)

def graph_us(calls):
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for c in calls: c()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls: c()
    return bench.bench_ms(g.replay) * 1e3 / len(calls)

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

H_Q, H_KV, D = 4096, 512, 2048
splits_qkv = (H_Q, H_KV, H_KV)
for name, N, K, splits in (("q", H_Q, D, None), ("kv", H_KV, D, None), ("o", D, H_Q, None),
                           ("qkv", sum(splits_qkv), D, splits_qkv)):
    w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
    w_q = (rac.stack_weights([nvfp4.quantize_weight(p) for p in w.split(splits)]) if splits
           else nvfp4.quantize_weight(w))
    n = max(1, min(64, math.ceil(180e6 / (N * K * 0.5625))))
    wqs = [nvfp4.NVFP4Tensor(w_q.data.clone(), w_q.block_scale.clone(), w_q.global_scale.clone()) for _ in range(n)]
    nb = max(1, min(64, math.ceil(180e6 / (N * K * 2))))
    ws = [w.clone() for _ in range(nb)]
    i4 = int4_weight(w); w4s = [tuple(t.clone() for t in i4) for _ in range(n)]
    x = torch.randn(1, K, device="cuda", dtype=bf16)
    mask = torch.arange(K // 16, device="cuda") % 2 == 0
    act = rac.quantize_activation_triton(x, mask)
    ref = rac.nvfp4_linear_triton(x, w_q, mask, splits=splits)
    ref = torch.cat([r.reshape(-1) for r in ref]) if splits else ref.reshape(-1)
    line = [f"bf16 {graph_us([lambda w=w: F.linear(x, w) for w in ws]):.1f}",
            f"int4 {graph_us([lambda w=w: torch._weight_int4pack_mm(x, w[0], 128, w[1]) for w in w4s]):.1f}",
            f"rac {graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask, splits=splits) for w in wqs]):.1f}",
            f"rac alone {graph_us([lambda w=w: rac._dense_portable(w, bf16, act=act, splits=splits) for w in wqs]):.1f}"]
    print(f"{name} {N}x{K}: " + ", ".join(line), flush=True)
    combos = [(bn, w, True, True) for bn, w in ((2, 4), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8))]
    for (bn, warps, _, _), prefetch, early in itertools.product(combos, (False, True), (False, True)):
        two = lambda w: G.gemv(x, w, splits=splits, block_n=bn, warps=warps, prefetch=prefetch,
                               act=rac.quantize_activation_triton(x, mask, early_launch=early))
        out = two(w_q); out = torch.cat([r.reshape(-1) for r in out]) if splits else out.reshape(-1)
        ok = torch.equal(out, ref)
        t2 = graph_us([lambda w=w: two(w) for w in wqs])
        print(f"  two launches bn {bn:2d} warps {warps} prefetch {int(prefetch)} early {int(early)}: {t2:5.1f} us{'' if ok else ' DIFFERS'}", flush=True)
    combos = [(4, 4, True, True)]
    for bn, warps, hoist, pre in combos:
        try:
            kw = dict(block_n=bn, warps=warps, hoist=hoist, act=act if pre else None)
            run = lambda w=w_q: G.gemv(x, w, None if pre else mask, splits=splits, **kw)
            out = run(); out = torch.cat([r.reshape(-1) for r in out]) if splits else out.reshape(-1)
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            t = graph_us([lambda w=w: G.gemv(x, w, None if pre else mask, splits=splits, **kw) for w in wqs])
            print(f"  bn {bn:2d} warps {warps} hoist {int(hoist)} {'pre  ' if pre else 'fused'}: {t:5.1f} us (vs rac {err:.1e})", flush=True)
        except Exception as e:
            print(f"  bn {bn} warps {warps} hoist {hoist} pre {pre} failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
