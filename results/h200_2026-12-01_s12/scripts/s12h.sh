#!/bin/bash
# Session 12, call H: the quantizer's and prefill's tests on the GPU, then bench.py gemm.
export PYTHONUNBUFFERED=1; L=$OUT; START=$(date +%s)
timeout 150 python -m pytest -q tests/test_rac.py -p no:cacheprovider \
  -k "partial_max or quantizer_matches or zeros_and_nan or launch_and_prefill or prefill_weight" > $L/tests_quantizer.log 2>&1
echo "tests rc=$? $(( $(date +%s) - START ))s"; tail -3 $L/tests_quantizer.log
timeout 200 python bench.py gemm > $L/gemm.log 2>&1; echo "gemm rc=$? $(( $(date +%s) - START ))s"
grep -i -A 12 "prefill" $L/gemm.log | head -40
