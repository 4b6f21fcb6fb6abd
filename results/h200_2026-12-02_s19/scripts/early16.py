"""GPU: the dense layer at M = 2..64 with the quantizer letting the GEMM launch early, against main's rule
(early launch at one row only). Same outputs required."""
import sys, math, torch
sys.path.insert(0, "results/h200_2026-12-02_s19/scripts")
import torch.nn.functional as F
import rac, nvfp4
from gemv_gpu_common import graph_us
bf16 = torch.bfloat16
torch.manual_seed(0)
main_input = rac.layer_input


def early_input(x, rac_mask):
    return rac.quantize_activation_triton(x, rac_mask, early_launch=True)


qkv = (4096, 512, 512)
shapes = (("q", 4096, 2048, None), ("kv", 512, 2048, None), ("o", 2048, 4096, None), ("qkv", 5120, 2048, qkv),
          ("gate_up", 12288, 2048, None), ("down", 2048, 6144, None))
for M in (16, 8, 32):
    for name, N, K, splits in shapes:
        w = torch.randn(N, K, device="cuda", dtype=bf16) * 0.02
        w_q = (rac.stack_weights([nvfp4.quantize_weight(p) for p in w.split(splits)]) if splits
               else nvfp4.quantize_weight(w))
        n = max(1, min(64, math.ceil(180e6 / (N * K * 0.5625))))
        wqs = [nvfp4.NVFP4Tensor(w_q.data.clone(), w_q.block_scale.clone(), w_q.global_scale.clone())
               for _ in range(n)]
        x = torch.randn(M, K, device="cuda", dtype=bf16)
        mask = torch.arange(K // 16, device="cuda") % 2 == 0
        layer = lambda w: rac.layer_matmul(rac.layer_input(x, mask), w, bf16, splits)
        rac.layer_input = main_input
        ref = layer(w_q)
        t_main = graph_us([lambda w=w: layer(w) for w in wqs])
        rac.layer_input = early_input
        out = layer(w_q)
        same = all(torch.equal(a, b) for a, b in zip(ref, out)) if splits else torch.equal(ref, out)
        t_early = graph_us([lambda w=w: layer(w) for w in wqs])
        t_main2 = None
        rac.layer_input = main_input
        t_main2 = graph_us([lambda w=w: layer(w) for w in wqs])
        print(f"M={M:2d} {name:7s}: main {t_main:5.1f} / {t_main2:5.1f}, early launch {t_early:5.1f} us "
              f"({t_early / min(t_main, t_main2):.3f}x), outputs equal {same}", flush=True)
