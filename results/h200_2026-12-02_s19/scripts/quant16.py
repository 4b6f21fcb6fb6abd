"""GPU: the quantizer at M = 1..16 with the amax in the launch (one launch) or by the partial-max launch."""
import sys, torch
sys.path.insert(0, "results/h200_2026-12-02_s19/scripts")
import rac
from gemv_gpu_common import graph_us
for M, K in ((1, 2048), (4, 2048), (8, 2048), (16, 2048), (16, 4096), (16, 6144)):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    mask = torch.arange(K // 16, device="cuda") % 2 == 0
    row = []
    for limit in (4096, 16384, 32768, 131072):
        rac.AMAX_IN_LAUNCH = limit
        a = rac.quantize_activation_triton(x, mask)
        rac.AMAX_IN_LAUNCH = 4096
        b = rac.quantize_activation_triton(x, mask)
        assert torch.equal(a.operand, b.operand)
        rac.AMAX_IN_LAUNCH = limit
        row.append(f"{limit}: {graph_us([lambda: rac.quantize_activation_triton(x, mask)] * 8):.2f}")
    rac.AMAX_IN_LAUNCH = 4096
    print(f"quantizer M={M} K={K}: " + ", ".join(row), flush=True)
