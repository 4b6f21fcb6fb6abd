"""GPU: the experts' Gluon kernel as a dense split-K GEMM (K split into S 'experts'), timed against rac's
dense GEMM (layer_matmul) and BF16 F.linear at M = 1..16. GEMM only: the activation is quantized once."""
import sys, math, itertools, torch
sys.path.insert(0, "results/h200_2026-12-02_s19/scripts")
import torch.nn.functional as F
import rac, nvfp4, triton
from gemv_gpu_common import graph_us
bf16 = torch.bfloat16
torch.manual_seed(0)


def split_weight(w_q, S):
    N, K = w_q.shape
    data = w_q.data.view(N, S, K // 2 // S).transpose(0, 1)
    scale = w_q.block_scale.view(N, S, K // 16 // S).transpose(0, 1)
    gs = w_q.global_scale.reshape(1).expand(S).contiguous()
    return rac.chunk_experts(nvfp4.NVFP4Tensor(data.contiguous(), scale.contiguous(), gs))


def split_operand(op, S):  # (2, M, K/2) -> (2, S*M, K/2/S), rows (s, m)
    _, M, H = op.shape
    return op.view(2, M, S, H // S).transpose(1, 2).reshape(2, S * M, H // S).contiguous()


def launch(act_op, gscale, w, counts, y, T, BN, BK, W, S, M):
    E, N, K = w.shape
    grid = (S * triton.cdiv(M, T), triton.cdiv(N, BN))
    rac._grouped_gluon_kernel.fn[grid](
        act_op, gscale, counts, counts, counts, w.data, w.block_scale.view(torch.uint8), w.global_scale,
        counts, y, N, K, E, 4, act_op.stride(0), act_op.stride(1), *w.data.stride()[:3],
        *w.block_scale.stride()[:3], y.stride(0), GATHER=False, ROW_WEIGHTS=False, WEIGHT_IDS=False,
        SWIGLU=False, E_POW2=max(2, triton.next_power_of_2(E)), CHUNK=w.chunk, PDL=False, BUCKET=4,
        BLOCK_T=T, BLOCK_N=BN, BLOCK_K=BK, NUM_WARPS=W, num_warps=W)


shapes = (("q", 4096, 2048), ("kv", 512, 2048), ("o", 2048, 4096), ("gate_up", 2 * 6144, 2048),
          ("down", 2048, 6144))
for M in (16, 8, 1):
    for name, N, K in shapes:
        w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
        w_q = nvfp4.quantize_weight(w)
        n = max(1, min(64, math.ceil(180e6 / (N * K * 0.5625))))
        wqs = [nvfp4.NVFP4Tensor(w_q.data.clone(), w_q.block_scale.clone(), w_q.global_scale.clone())
               for _ in range(n)]
        ws = [w.clone() for _ in range(max(1, min(64, math.ceil(180e6 / (N * K * 2)))))]
        x = torch.randn(M, K, device="cuda", dtype=bf16)
        mask = torch.arange(K // 16, device="cuda") % 2 == 0
        act = rac.quantize_activation_triton(x, mask)
        ref = rac.layer_matmul(act, w_q, torch.float32)
        t_bf16 = graph_us([lambda w=w: F.linear(x, w) for w in ws])
        t_rac = graph_us([lambda w=w: rac.layer_matmul(act, w, bf16) for w in wqs])
        t_layer = graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask) for w in wqs])
        print(f"M={M} {name} {N}x{K}: bf16 {t_bf16:.1f}, rac GEMM {t_rac:.1f}, rac layer {t_layer:.1f}",
              flush=True)
        best = []
        for S in (1, 2, 4, 8, 16):
            if K % (S * 128):
                continue
            ws_split = [split_weight(q, S) for q in wqs]
            op = split_operand(act.operand, S)
            counts = torch.full((S,), M, device="cuda", dtype=torch.int32)
            y = torch.empty(S * M, N, device="cuda", dtype=torch.float32)
            for T, (BN, W), BK in itertools.product((8, 16) if M > 8 else (8,),
                                                     ((16, 1), (32, 2), (64, 4), (128, 4), (64, 2)),
                                                     (64, 128)):
                if T < M and T == 8 and M == 16:
                    pass
                try:
                    launch(op, act.global_scale, ws_split[0], counts, y, T, BN, BK, W, S, M)
                    out = y.view(S, M, N).sum(0)
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    t = graph_us([lambda w=w: launch(op, act.global_scale, w, counts, y, T, BN, BK, W, S, M)
                                  for w in ws_split])
                    best.append((t, S, T, BN, BK, W, err))
                except Exception as e:
                    print(f"  S {S} T {T} BN {BN} BK {BK} W {W} failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:150]}", flush=True)
        best.sort()
        for t, S, T, BN, BK, W, err in best[:6]:
            print(f"  gluon split S {S:2d} T {T:2d} BN {BN:3d} BK {BK:3d} W {W}: {t:5.1f} us (err {err:.1e})",
                  flush=True)
