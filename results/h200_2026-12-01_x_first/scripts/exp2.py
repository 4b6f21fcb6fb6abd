"""PREFILL_ROWS for M = 64 / 256 (weight decoded once), and BLOCK_M 32 grouped configs at T = 256."""
import math, sys
sys.argv = [sys.argv[0]]
exec(open(".dev19/exp.py").read().split("which = sys.argv[1:]")[0])
for name, N, K in (("q", 4096, 2048), ("kv", 512, 2048), ("o", 2048, 4096)):
    w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
    wq = nvfp4.quantize_weight(w)
    n = max(1, min(64, math.ceil(180e6 / (2 * N * K)))); n4 = max(1, min(64, math.ceil(180e6 / (N * K * 0.5625))))
    ws = [w.clone() for _ in range(n)]
    wqs = [nvfp4.NVFP4Tensor(wq.data.clone(), wq.block_scale.clone(), wq.global_scale.clone()) for _ in range(n4)]
    for M in (16, 64, 128, 256, 512):
        x = torch.randn(M, K, device="cuda", dtype=bf16)
        mask = torch.arange(K // 16, device="cuda") % 2 == 0
        tb = graph_us([lambda w=w: F.linear(x, w) for w in ws])
        rac.PREFILL_ROWS = 1024
        ta = graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask) for w in wqs])
        rac.PREFILL_ROWS = 1
        tp = graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask) for w in wqs])
        rac.PREFILL_ROWS = 1024
        print(f"dense {name} M={M}: bf16 {tb:.1f}  in-register {ta:.1f}  weight-decoded-once {tp:.1f}", flush=True)
D, E, A, I = 2048, 128, 8, 768
gate_up_q = nvfp4.quantize_weight(torch.randn(E, 2 * I, D, device="cuda", dtype=bf16) * 0.02)
down_q = nvfp4.quantize_weight(torch.randn(E, D, I, device="cuda", dtype=bf16) * 0.02)
entries = [(bm, bn, bk, w, s, 1, False) for bm, bn, bk, w, s in
           ((16, 32, 256, 4, 3), (16, 64, 256, 4, 3), (32, 32, 256, 4, 3), (32, 64, 256, 4, 3), (32, 64, 128, 4, 3),
            (32, 128, 128, 4, 3), (32, 32, 128, 4, 3), (32, 64, 256, 8, 3), (64, 64, 128, 4, 3), (32, 128, 128, 8, 3))]
for T in (64, 256):
    x = torch.randn(T, D, device="cuda", dtype=bf16)
    routing = moe.route_tokens(torch.rand(T, E, device="cuda").topk(A, dim=-1).indices, E)
    act_x = rac.quantize_activation_triton(x)
    act_h = rac.quantize_activation_triton(torch.randn(T * A, I, device="cuda", dtype=bf16))
    bucket = rac._m_bucket(-(-T * A // E), rac.GROUPED_CONFIGS)
    print(f"\nexperts T={T} max rows/expert {int(routing.counts.max())}")
    for label in force(rac._grouped_kernel, bucket, entries):
        tg = graph_us([lambda: rac.grouped_matmul_triton(act_x, gate_up_q, routing.counts, row_ids=routing.token_ids, swiglu=True)])
        td = graph_us([lambda: rac.grouped_matmul_triton(act_h, down_q, routing.counts)])
        print(f"{label:28s} gate_up {tg:7.1f}  down {td:7.1f}", flush=True)
