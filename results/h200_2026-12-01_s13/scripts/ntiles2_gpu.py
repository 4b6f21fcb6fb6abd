"""Grouped GEMMs (Qwen3-30B-A3B experts, 128 top-8): N_TILES N tiles a program in one flattened loop over (tile, K
step), so the pipeline runs across tiles, against the table's picks (one tile a program)."""
import sys, torch, triton, moe, nvfp4, rac

def graph_us(fn, n=10, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
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
E, D, I, A = 128, 2048, 768, 8
gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02)
down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02)
kernel = rac._grouped_kernel

def cfg(bm, bn, bk, w, s, mr=None, nt=1):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "BUCKET": 16, "X_FIRST": True,
                          "N_TILES": nt}, num_warps=w, num_stages=s, maxnreg=mr)

GU = [("pick 16/64/256 2s mr128", cfg(16, 64, 256, 4, 2, 128))]
DN = [("pick 16/128/128 3s", cfg(16, 128, 128, 4, 3)),
      ("16/128/128 3s nt4", cfg(16, 128, 128, 4, 3, None, 4)),
      ("16/128/256 2s nt1", cfg(16, 128, 256, 4, 2, None, 1)),
      ("16/128/256 2s nt2", cfg(16, 128, 256, 4, 2, None, 2)),
      ("16/128/256 2s nt3", cfg(16, 128, 256, 4, 2, None, 3)),
      ("16/128/256 2s nt4", cfg(16, 128, 256, 4, 2, None, 4)),
      ("16/128/256 2s nt8", cfg(16, 128, 256, 4, 2, None, 8)),
      ("16/128/256 3s nt4", cfg(16, 128, 256, 4, 3, None, 4)),
      ("16/128/256 2s mr128 nt4", cfg(16, 128, 256, 4, 2, 128, 4)),
      ("16/64/256 2s nt4", cfg(16, 64, 256, 4, 2, None, 4)),
      ("16/64/256 2s nt8", cfg(16, 64, 256, 4, 2, None, 8)),
      ("16/256/128 2s nt2", cfg(16, 256, 128, 4, 2, None, 2)),
      ("16/256/128 2s nt4", cfg(16, 256, 128, 4, 2, None, 4)),
      ("16/128/256 2s nt4 8w", cfg(16, 128, 256, 8, 2, None, 4)),
      ("16/128/128 2s nt4", cfg(16, 128, 128, 4, 2, None, 4))]
for T in (64, 256):
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    counts = routing.counts.cpu()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    act_x = rac.quantize_activation_triton(x, torch.arange(D // 16, device="cuda") % 2 == 0)
    act_h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=torch.bfloat16),
                                           torch.arange(I // 16, device="cuda") % 2 == 0)
    row_weights = torch.rand(T * A, device="cuda")
    gu = lambda: rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True)
    expert_weights = torch.rand(T * A, device="cuda")
    dn = lambda: rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=expert_weights,
                                           row_weight_ids=routing.order)
    kernel.configs = [DN[0][1]]; kernel.cache.clear()
    sorted_w = expert_weights[routing.order].float()
    assert torch.equal(dn(), rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=sorted_w))
    print(f"  weights read through routing.order: bit-identical to the gathered sorted weights; "
          f"down (pick) with ids {graph_us(dn):.1f} us, with sorted weights "
          f"{graph_us(lambda: rac.grouped_matmul_triton(act_h, down_q, routing.counts, row_weights=sorted_w)):.1f} us, "
          f"the gather alone {graph_us(lambda: expert_weights[routing.order].float()):.1f} us")
    print(f"T={T}: rows an expert max {counts.max().item()}, experts > 16 rows: {(counts > 16).sum().item()}, "
          f"16-row tiles {((counts + 15) // 16).sum().item()}, 32-row tiles {((counts + 31) // 32).sum().item()}")
    for name, fn, table in (("gate/up", gu, GU), ("down", dn, DN)):
        ref = None
        for label, c in table:
            kernel.configs = [c]; kernel.cache.clear()
            try:
                y = fn(); again = fn()
                if ref is None:
                    ref = y.clone()
                same = torch.equal(y, ref)
                err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                t = graph_us(fn)
                print(f"  {name:8s} {label:34s} {t:7.1f} us  bit-identical to pick: {same}  rel {err:.1e}  "
                      f"repeat equal: {torch.equal(y, again)}", flush=True)
            except Exception as e:
                print(f"  {name:8s} {label:34s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
