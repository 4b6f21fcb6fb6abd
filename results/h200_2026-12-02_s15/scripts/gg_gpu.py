"""GPU: the Gluon grouped GEMM prototype against rac's Triton kernel: agreement and CUDA-graph time."""
import os, sys, time
sys.path.insert(0, os.path.dirname(__file__))
import torch
import moe, nvfp4, rac
import gg

torch.manual_seed(0)
E, D, I, A = 128, 2048, 768, 8
dev = "cuda"
gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16) * 0.02)
down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device=dev, dtype=torch.bfloat16) * 0.02)

def graph_us(fn, n=20, reps=30):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn()
    g.replay(); torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = torch.cuda.Event(enable_timing=True); t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(reps): g.replay()
        t1.record(); torch.cuda.synchronize()
        best = min(best, t0.elapsed_time(t1) * 1e3 / reps / n)
    return best

def cmp(a, b):
    a, b = a.float(), b.float()
    return f"max|d| {((a - b).abs().max() / b.abs().max()).item():.2e} rel, equal {(a == b).float().mean().item():.4f}"

P = lambda **k: ("pf", k)
C = lambda **k: ("cp", k)
T_ = lambda **k: ("tiled", k)
GU = [T_(), T_(BLOCK_T=8), T_(BLOCK_K=64), T_(BLOCK_T=32, BLOCK_K=64), T_(BLOCK_T=32, BLOCK_K=64, maxnreg=128),
      T_(BLOCK_T=32, BLOCK_N=32), T_(BLOCK_T=32, BLOCK_N=32, BLOCK_K=64), T_(BLOCK_T=16, BLOCK_N=32, BLOCK_K=64),
      T_(BLOCK_T=32, BLOCK_K=64, num_warps=8, BLOCK_N=128), T_(BLOCK_T=8, BLOCK_K=64), T_(BLOCK_T=16, maxnreg=96)]
DN = [T_(BLOCK_N=128), T_(BLOCK_T=8, BLOCK_N=128), T_(BLOCK_T=32, BLOCK_N=128, BLOCK_K=64), T_(BLOCK_T=16, BLOCK_N=128, BLOCK_K=64),
      T_(BLOCK_T=32, BLOCK_N=64, BLOCK_K=64), T_(BLOCK_T=32, BLOCK_N=128, BLOCK_K=64, maxnreg=128),
      T_(BLOCK_T=8, BLOCK_N=128, BLOCK_K=64), T_(BLOCK_T=16, BLOCK_N=256, num_warps=8)]
FN = {"pf": gg.grouped_matmul, "cp": gg.grouped_matmul_cp}
TILED = {}
def tiled_fn(act, w_q, counts, swiglu=False, **kw):
    cfg = {k: kw.pop(k) for k in ("BLOCK_T", "BLOCK_N", "BLOCK_K", "num_warps", "maxnreg") if k in kw}
    key = (id(w_q), swiglu, cfg.get("BLOCK_N", 64), cfg.get("BLOCK_K", 128))
    if key not in TILED:
        TILED[key] = gg.tile_weights(w_q, swiglu, key[2], key[3])
    return gg.grouped_matmul_tiled(act, w_q, TILED[key], counts, swiglu=swiglu, **kw, **cfg)
FN["tiled"] = tiled_fn
for T in (64, 256):
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(T, E, device=dev).topk(A, dim=-1).indices
    wts = torch.softmax(torch.randn(T, A, device=dev), dim=-1).reshape(-1)
    routing = moe.route_tokens(ids, E)
    act_x = rac.quantize_activation_triton(x, codes=True)
    h = torch.randn(T * A, I, device=dev, dtype=torch.bfloat16)
    act_h = rac.quantize_activation_triton(h, codes=True)
    print(f"\n## {T} tokens: {int((routing.counts > 0).sum())} experts hit, max rows {int(routing.counts.max())}")
    ref_gu = rac.grouped_matmul_reference(act_x.x_q, gate_up_q, routing.counts, row_ids=routing.token_ids,
                                          swiglu=True)
    tri_gu = rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True)
    t_tri = graph_us(lambda: rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids,
                                                       swiglu=True))
    print(f"gate/up triton: {t_tri:.1f} us; vs twin {cmp(tri_gu, ref_gu)}")
    for cfg in GU:
        try:
            f = lambda: FN[cfg[0]](act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True, **cfg[1])
            y = f(); torch.cuda.synchronize()
            y2 = f(); torch.cuda.synchronize()
            print(f"gate/up gluon {cfg}: {graph_us(f):.1f} us; vs twin {cmp(y, ref_gu)}; vs triton {cmp(y, tri_gu)}; "
                  f"repeat equal {bool((y == y2).all())}", flush=True)
        except Exception as e:
            print(f"gate/up gluon {cfg}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
    ref_dn = rac.grouped_matmul_reference(act_h.x_q, down_q, routing.counts, row_weights=wts,
                                          row_weight_ids=routing.order)
    tri_dn = rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=wts, row_weight_ids=routing.order)
    t_tri = graph_us(lambda: rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=wts,
                                                       row_weight_ids=routing.order))
    print(f"down triton: {t_tri:.1f} us; vs twin {cmp(tri_dn, ref_dn)}")
    for cfg in DN:
        try:
            f = lambda: FN[cfg[0]](act_h, down_q, routing.counts, row_weights=wts, row_weight_ids=routing.order,
                                   **cfg[1])
            y = f(); torch.cuda.synchronize()
            print(f"down gluon {cfg}: {graph_us(f):.1f} us; vs twin {cmp(y, ref_dn)}; vs triton {cmp(y, tri_dn)}",
                  flush=True)
        except Exception as e:
            print(f"down gluon {cfg}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
