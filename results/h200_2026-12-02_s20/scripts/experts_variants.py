"""Experts' Gluon kernel at 64 / 256 decode tokens (Qwen3-30B-A3B shapes): main's kernel (95f4a8f) against the
unmasked-loads kernel, each configuration forced, with register caps and 8-warp variants; GEMMs alone, us."""
import sys, torch, triton
sys.path.insert(0, ".devnext/s20")
import bench, moe, nvfp4, rac, rac_main
from gemv_gpu_common import graph_us
print(bench.gpu_header() if hasattr(bench, "gpu_header") else "")
torch.manual_seed(0)
E, D, I, A = 128, 2048, 768, 8
bf16 = torch.bfloat16
gate_up = torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02
down = torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02
gq, dq = nvfp4.quantize_weight(gate_up), nvfp4.quantize_weight(down)
weights = {m: (m.chunk_experts(gq), m.chunk_experts(dq)) for m in (rac_main, rac)}
copy_bw = bench.copy_bandwidth()
for T in (64, 256):
    x = torch.randn(T, D, device="cuda", dtype=bf16)
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    ew = torch.softmax(torch.randn(T, A, device="cuda"), dim=-1).reshape(-1)
    hit = int((routing.counts > 0).sum())
    floor = [hit * n * (0.5 + 1 / 16) / copy_bw * 1e6 for n in (2 * I * D, D * I)]
    bucket = rac._m_bucket(triton.cdiv(T * A, E), rac.GLUON_CONFIGS)
    base = [tuple(c) for c in rac.GLUON_CONFIGS[bucket]]
    cands = {rac_main: [c + (None,) for c in base],
             rac: [c + (cap,) for c in base for cap in (None, 96, 80)]
                  + [(t, n, k, 8, None) for t, n, k, w in base if w == 4]}
    print(f"\n## T = {T}, bucket {bucket}, experts hit {hit}, floor gate/up {floor[0]:.1f} down {floor[1]:.1f} us")
    print("| kernel | config | gate/up | down | sum | same bits as main |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    first = {}
    h_input = torch.randn(T * A, I, device="cuda", dtype=bf16)
    for m in (rac_main, rac):
        act_x, act_h = m.quantize_activation_triton(x), m.quantize_activation_triton(h_input)
        gw, dw = weights[m]
        calls = (lambda: m.grouped_matmul_triton(act_x, gw, routing.counts, row_ids=routing.token_ids, swiglu=True),
                 lambda: m.grouped_matmul_triton(act_h, dw, routing.counts, row_weights=ew,
                                                 row_weight_ids=routing.order))
        kernel = m._grouped_gluon_kernel
        saved = list(kernel.configs)
        name = "main" if m is rac_main else "unmasked"
        for t, n, k, w, cap in cands[m] + [(None,) * 5]:
            label = "autotuned"
            try:
                if t is not None:
                    kernel.configs = [triton.Config({"BLOCK_T": t, "BLOCK_N": n, "BLOCK_K": k, "NUM_WARPS": w,
                                                     "BUCKET": bucket}, num_warps=w, maxnreg=cap)]
                    label = f"{t}/{n}/{k} {w}w" + (f" maxnreg {cap}" if cap else "")
                else:
                    kernel.configs = saved
                kernel.cache.clear()
                outs = [c() for c in calls]
                key = label.split(" ")[0]  # main's run of the same tile (caps and warps change no sum)
                first.setdefault(key, outs)
                same = all(torch.equal(o, r) for o, r in zip(outs, first[key]))
                us = [graph_us([c]) for c in calls]
                print(f"| {name} | {label} | {us[0]:.1f} | {us[1]:.1f} | {sum(us):.1f} | {same} |", flush=True)
            except Exception as e:
                print(f"| {name} | {label} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |",
                      flush=True)
        kernel.configs = saved
        kernel.cache.clear()
