"""GPU round 2: M = 1 stage drops; quantizer + Gluon GEMM at M = 16 / 64 / 256 against rac's layer and BF16."""
import math, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import torch, torch.nn.functional as F
import nvfp4, rac
import gd
from gd_gpu import bench_us, int4_weight
torch.manual_seed(0)
bf16 = torch.bfloat16
which = sys.argv[1]
shapes = [("q_proj", 4096, 2048, None), ("k/v_proj", 512, 2048, None), ("o_proj", 2048, 4096, None),
          ("qkv stacked", 5120, 2048, (4096, 512, 512))]
flat = lambda o: torch.cat([c.reshape(-1) for c in o]) if isinstance(o, tuple) else o.reshape(-1)
def rel(a, b):
    a, b = flat(a).float(), flat(b).float()
    return ((a - b).abs().max() / b.abs().max()).item()
for name, N, K, splits in shapes:
    w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
    w_q = (rac.stack_weights([nvfp4.quantize_weight(p) for p in w.split(splits)]) if splits
           else nvfp4.quantize_weight(w))
    mask = (torch.arange(K // 16, device="cuda") % 2 == 0)
    nbytes = N * K * (0.5 + 1 / 16)
    ncopy = max(1, min(64, math.ceil(180e6 / nbytes)))
    wqs = [nvfp4.NVFP4Tensor(w_q.data.clone(), w_q.block_scale.clone(), w_q.global_scale.clone()) for _ in range(ncopy)]
    wbs = [w.clone() for _ in range(max(1, min(64, math.ceil(180e6 / (2 * N * K)))))]
    if which == "m1":
        x = torch.randn(1, K, device="cuda", dtype=bf16)
        t_bf = bench_us([lambda w=w_: F.linear(x, w) for w_ in wbs])
        t_cur = bench_us([lambda wq=wq: rac.nvfp4_linear_triton(x, wq, mask, splits=splits) for wq in wqs])
        print(f"{name} M=1: bf16 {t_bf:.1f} rac-now {t_cur:.1f} us", flush=True)
        for bn, bk, st in ((128, 256, 1), (64, 256, 1), (64, 512, 1), (64, 512, K // 512), (128, 512, K // 512),
                           (128, 256, K // 256), (32, 512, K // 512)):
            if N % bn and not splits: continue
            line = []
            for drop in range(5):
                kw = dict(BLOCK_N=bn, BLOCK_K=bk, STEPS=st, num_warps=min(4, bn // 16), LOAD_FIRST=drop != 3, pdl=True, DROP=drop)
                t = bench_us([lambda wq=wq: gd.dense_gluon(x, wq, mask, splits=splits, **kw) for wq in wqs])
                line.append(f"{t:.1f}")
            print(f"  {bn}/{bk}x{st} (splits {K // (bk * st)}): full / no amax / no quant / no weights / empty: "
                  + " / ".join(line), flush=True)
    else:
        for M in (16, 64, 256):
            x = torch.randn(M, K, device="cuda", dtype=bf16)
            t_bf = bench_us([lambda w=w_: F.linear(x, w) for w_ in wbs])
            t_cur = bench_us([lambda wq=wq: rac.nvfp4_linear_triton(x, wq, mask, splits=splits) for wq in wqs])
            act = rac.quantize_activation_triton(x, mask)
            t_q = bench_us([lambda: rac.quantize_activation_triton(x, mask)])
            cur = rac.nvfp4_linear_triton(x, w_q, mask, splits=splits)
            print(f"{name} M={M}: bf16 {t_bf:.1f} rac-now {t_cur:.1f} quantizer alone {t_q:.1f} us", flush=True)
            cfgs = {16: [(16, 64, 128, K), (16, 64, 128, 512), (16, 64, 128, 256), (16, 128, 128, 512), (8, 64, 128, 512),
                         (16, 32, 128, 256), (16, 64, 64, 512)],
                    64: [(64, 64, 64, K), (32, 64, 64, K), (32, 64, 64, 1024), (32, 64, 64, 512), (16, 64, 128, 512),
                         (64, 64, 64, 512), (32, 128, 64, 1024), (64, 128, 64, 1024)],
                    256: [(64, 64, 64, K), (64, 128, 64, K), (32, 64, 64, K), (32, 128, 64, K), (64, 64, 128, K),
                          (64, 64, 64, 1024), (64, 128, 64, 1024), (32, 128, 64, 1024)]}[M]
            for bt, bn, bk, ks in cfgs:
                if K % ks: continue
                kw = dict(BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, STEPS=ks // bk, num_warps=min(4, bn // 16), pdl=True)
                try:
                    out = gd.dense_gluon(None if False else x, w_q, mask, splits=splits, act=act, **kw)
                    d = rel(out, cur)
                    t_g = bench_us([lambda wq=wq: gd.dense_gluon(x, wq, mask, splits=splits, act=act, **kw) for wq in wqs])
                    def layer(wq):
                        a = rac.quantize_activation_triton(x, mask)
                        return gd.dense_gluon(x, wq, mask, splits=splits, act=a, **kw)
                    t_l = bench_us([lambda wq=wq: layer(wq) for wq in wqs])
                    print(f"  {bt}/{bn}/{bk} k-split {ks}: GEMM {t_g:.1f} layer {t_l:.1f} us ({t_bf / t_l:.2f}x bf16, "
                          f"{t_cur / t_l:.2f}x rac-now) vs rac {d:.1e}", flush=True)
                except Exception as e:
                    print(f"  {bt}/{bn}/{bk}/{ks}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
