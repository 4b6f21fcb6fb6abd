#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
timeout 150 python bench.py gemm > $L/gemm.log 2>&1; t "gemm rc=$?"
for i in 1 2; do timeout 80 python bench.py decode > $L/decode_run$i.log 2>&1; t "decode $i rc=$?"; done
timeout 60 python -m pytest -q -m cuda tests/test_rac.py -k "dense_kernel_matches_the_twin_on_gpu or grouped" > $L/tests.log 2>&1; t "tests rc=$?"; tail -1 $L/tests.log
grep -h "rac nvfp4 / rac bf16\|rac nvfp4 / rac fp8\|RAC 0.5 / rac" $L/decode_run*.log
grep "| 1 |" $L/gemm.log | head -4 | cut -c1-120; grep -A4 "### Expert layer" $L/gemm.log | tail -2 | cut -c1-120
