#!/bin/bash
# Session 5's final device call: every CUDA test, bench.py decode and gemm, a quantizer slice-count variant.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
START=$(date +%s)
L=/tmp/logs; mkdir -p $L
t() { echo "$1 $(( $(date +%s) - START ))s" >> $L/times.log; tar czf $OUT/logs.tgz -C $L . 2>/dev/null; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $L/env.log
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $L/env.log
timeout 250 python -m pytest -q -m cuda -rf --durations=8 tests > $L/tests.log 2>&1; t "tests rc=$?"
timeout 100 python bench.py decode > $L/decode.log 2>&1; t "decode rc=$?"
timeout $(( 545 - ($(date +%s) - START) )) python bench.py gemm > $L/gemm.log 2>&1; t "gemm rc=$?"
if [ $(( $(date +%s) - START )) -lt 540 ]; then
timeout $(( 570 - ($(date +%s) - START) )) python - > $L/amax.log 2>&1 <<'PY'
import torch, triton, nvfp4, rac
for N, K in ((512, 2048), (2048, 4096)):
    x = torch.randn(4096, K, device="cuda", dtype=torch.bfloat16)
    mask = torch.arange(K // 16, device="cuda") % 2 == 0
    wq = nvfp4.quantize_weight(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02)
    for slices in (256, 1024):
        rac._AMAX_SLICES = slices
        f = lambda: rac.nvfp4_linear_triton(x, wq, mask)
        g = lambda: rac.quantize_activation_triton(x, mask)
        print(N, K, "slices", slices, "layer us", 1e3 * triton.testing.do_bench(f, return_mode="median"),
              "quantizer us", 1e3 * triton.testing.do_bench(g, return_mode="median"), flush=True)
PY
t "amax rc=$?"
fi
t "end"
cat $L/times.log $L/env.log; tail -4 $L/tests.log; tail -22 $L/decode.log; cat $L/amax.log 2>/dev/null | tail -4
grep -A40 "### Expert" $L/gemm.log | head -8; grep -A8 "### Dense projections, prefill" $L/gemm.log
