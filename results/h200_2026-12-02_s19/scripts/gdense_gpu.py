"""GPU: the Gluon split-K dense prototype (gdense) against rac's layer, BF16 and int4 at decode sizes."""
import sys, math, itertools, torch
sys.path.insert(0, "results/h200_2026-12-02_s19/scripts")
import torch.nn.functional as F
import rac, nvfp4, gdense
from gemv_gpu_common import graph_us
bf16 = torch.bfloat16
torch.manual_seed(0)


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


def flat(out):
    return torch.cat([o.reshape(-1) for o in out]) if isinstance(out, tuple) else out.reshape(-1)


H_Q, H_KV, D = 4096, 512, 2048
qkv = (H_Q, H_KV, H_KV)
shapes = (("q", H_Q, D, None), ("kv", H_KV, D, None), ("o", D, H_Q, None), ("qkv", sum(qkv), D, qkv),
          ("gate_up", 2 * 6144, D, None), ("down", D, 6144, None))
# correctness first: odd M, every shape, both early modes, fp32 out, vs rac's own GEMM (== twin on GPU tests)
for (name, N, K, splits), M in itertools.product(shapes, (1, 3, 8, 16, 17, 64)):
    w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
    w_q = (rac.stack_weights([nvfp4.quantize_weight(p) for p in w.split(splits)]) if splits
           else nvfp4.quantize_weight(w))
    x = torch.randn(M, K, device="cuda", dtype=bf16)
    act = rac.quantize_activation_triton(x, torch.arange(K // 16, device="cuda") % 2 == 0)
    ref = flat(rac.layer_matmul(act, w_q, torch.float32, splits)).float()
    twin = flat(rac.matmul_reference(*(lambda a: (a.x_q, w_q, a.residual))(
        rac.quantize_activation_triton(x, torch.arange(K // 16, device="cuda") % 2 == 0, codes=True)),
        out_dtype=torch.float32)) if not splits else None
    worst = 0.0
    for T, S, early in itertools.product((8, 16) if M <= 16 else (16, 32), (1, 4, 16), (True, False)):
        for rep in range(3):
            out = flat(gdense.dense_gluon(act, w_q, torch.float32, splits, T=T, S=S, early_w=early))
            worst = max(worst, ((out - ref).abs().max() / ref.abs().max()).item())
    line = f"check M={M} {name}: max rel diff vs rac GEMM {worst:.1e}"
    if twin is not None:
        line += f"; vs twin {((out - twin).abs().max() / twin.abs().max()).item():.1e}"
    print(line, flush=True)

for M in (1, 16, 8, 4, 64):
    for name, N, K, splits in shapes:
        if M == 64 and name not in ("q", "o"):
            continue
        w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
        w_q = (rac.stack_weights([nvfp4.quantize_weight(p) for p in w.split(splits)]) if splits
               else nvfp4.quantize_weight(w))
        n = max(1, min(64, math.ceil(180e6 / (N * K * 0.5625))))
        wqs = [nvfp4.NVFP4Tensor(w_q.data.clone(), w_q.block_scale.clone(), w_q.global_scale.clone())
               for _ in range(n)]
        ws = [w.clone() for _ in range(max(1, min(64, math.ceil(180e6 / (N * K * 2)))))]
        i4 = int4_weight(w)
        w4s = [tuple(t.clone() for t in i4) for _ in range(n)]
        x = torch.randn(M, K, device="cuda", dtype=bf16)
        mask = torch.arange(K // 16, device="cuda") % 2 == 0
        t_bf16 = graph_us([lambda w=w: F.linear(x, w) for w in ws])
        t_int4 = graph_us([lambda w=w: torch._weight_int4pack_mm(x, w[0], 128, w[1]) for w in w4s])
        t_rac = graph_us([lambda w=w: rac.nvfp4_linear_triton(x, w, mask, splits=splits) for w in wqs])
        act = rac.quantize_activation_triton(x, mask)
        t_quant = graph_us([lambda: rac.quantize_activation_triton(x, mask, early_launch=True)] * 20)
        print(f"M={M} {name} {N}x{K}: bf16 {t_bf16:.1f}, int4 {t_int4:.1f}, rac layer {t_rac:.1f}, "
              f"quantizer {t_quant:.1f}", flush=True)
        res = []
        Ts = (8,) if M <= 8 else (16,) if M == 16 else (16, 32, 64)
        for T, (BN, W), (BK, S), early in itertools.product(
                Ts, ((32, 2), (64, 4), (128, 4)), ((128, 8), (128, 16), (128, 32), (64, 32), (128, 4)),
                (True, False)):
            if K % (BK * S) or (not early and BN != 64):
                continue
            try:
                layer = lambda w: gdense.dense_gluon(rac.quantize_activation_triton(x, mask, early_launch=True),
                                                     w, bf16, splits, T=T, BN=BN, BK=BK, S=S, W=W, early_w=early)
                t = graph_us([lambda w=w: layer(w) for w in wqs])
                alone = graph_us([lambda w=w: gdense.dense_gluon(act, w, bf16, splits, T=T, BN=BN, BK=BK, S=S, W=W,
                                                                 early_w=early) for w in wqs])
                res.append((t, alone, T, BN, W, BK, S, early))
            except Exception as e:
                print(f"  T {T} BN {BN} BK {BK} S {S} failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}",
                      flush=True)
        res.sort()
        for t, alone, T, BN, W, BK, S, early in res[:5]:
            print(f"  layer {t:5.1f} (GEMM alone {alone:4.1f}) T {T} BN {BN} W {W} BK {BK} S {S} early {int(early)}"
                  f"  -> {t_bf16 / t:.2f}x bf16, {t_int4 / t:.2f}x int4", flush=True)
        ne = [r for r in res if not r[7]]
        if ne:
            print(f"  best without early weight loads: {ne[0][0]:.1f}", flush=True)
