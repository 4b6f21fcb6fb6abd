#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
timeout 120 python -m pytest -q -m cuda tests/test_rollout.py -k "captures_rac_rollout_layers" > $L/tests_rollout.log 2>&1; t "tests rc=$?"; tail -2 $L/tests_rollout.log
for i in 1 2; do timeout 110 python bench.py decode > $L/decode_run$i.log 2>&1; t "decode $i rc=$?"; done
timeout 200 python bench.py gemm > $L/gemm.log 2>&1; t "gemm rc=$?"
grep -h "| nvfp4\|| bf16\|| fp8" $L/decode_run*.log | head -24
grep -A4 "### Expert layer" $L/gemm.log | cut -c1-200
