"""GPU (next session): the warp-specialized prototype (ws.py) against rac's Gluon experts kernel: equality, timing.
usage: MAXNREG=128 python .devnext/s17/ws_gpu.py   (MAXNREG: the kernel's register cap; unset = none)"""
import sys, itertools, torch, triton
sys.path.insert(0, ".devnext/s17")
import os
import rac, moe, nvfp4, bench, ws
print(bench.gpu_header(), flush=True)
bf16 = torch.bfloat16
D, E, A, I = 2048, 128, 8, 768

def graph_us(call):
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2): call()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): call()
    return bench.bench_ms(g.replay) * 1e3

torch.manual_seed(0)
gate_up = torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02
down = torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02
gu_q, dn_q = nvfp4.quantize_weight(gate_up), nvfp4.quantize_weight(down)
gu_w, dn_w = rac.chunk_experts(gu_q), rac.chunk_experts(dn_q)
sweep = sys.argv[1] if len(sys.argv) > 1 else "full"
for T in (64, 256):
    x = torch.randn(T, D, device="cuda", dtype=bf16)
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    rw = torch.softmax(torch.randn(T, A, device="cuda"), dim=-1).reshape(-1)
    act_x = rac.quantize_activation_triton(x, torch.arange(D // 16, device="cuda") % 2 == 0)
    act_h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=bf16),
                                           torch.arange(I // 16, device="cuda") % 2 == 0)
    gu = dict(row_ids=routing.token_ids, swiglu=True)
    dn = dict(row_weights=rw, row_weight_ids=routing.order)
    ref_gu = rac.grouped_matmul_triton(act_x, gu_w, routing.counts, out_dtype=torch.float32, **gu)
    ref_dn = rac.grouped_matmul_triton(act_h, dn_w, routing.counts, out_dtype=torch.float32, **dn)
    t_ref_gu = graph_us(lambda: rac.grouped_matmul_triton(act_x, gu_w, routing.counts, **gu))
    t_ref_dn = graph_us(lambda: rac.grouped_matmul_triton(act_h, dn_w, routing.counts, **dn))
    print(f"T={T} rac Gluon (mma.sync, autotuned): gate/up {t_ref_gu:.1f} us, down {t_ref_dn:.1f} us", flush=True)
    tiles = (8, 16) if T == 64 else (16, 32)
    for tile, bn, stages, warps in [c for c in itertools.product(tiles, (64, 128), (3, 6), (4, 8))
                                    if c[3] == 4 or c[1] == 128]:
        res = []
        for name, act, w, kw, ref in (("gate/up", act_x, gu_w, gu, ref_gu), ("down", act_h, dn_w, dn, ref_dn)):
            try:
                run = lambda dt=torch.bfloat16: ws.grouped(act, w, routing.counts, T=tile, BN=bn, BK=64, out_dtype=dt,
                                                           stages=stages, warps=warps, **kw)
                out, again = run(torch.float32), run(torch.float32)
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                rep = torch.equal(out, again)
                t = graph_us(run)
                res.append(f"{name} {t:6.1f} us (rel err {err:.1e}{'' if rep else ' NOT REPEATABLE'})")
            except Exception as e:
                res.append(f"{name} failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
        print(f"  ws {tile}/{bn}/64 stages={stages} warps={warps}: " + "; ".join(res), flush=True)
