#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $L/smi.txt
timeout 250 python -m pytest -q -m cuda tests/test_rac.py -k "every_gpu_config" > $L/tests.log 2>&1; t "every-config rc=$?"; tail -3 $L/tests.log
timeout 120 python .devnext/prof_decode.py > $L/prof.log 2>&1; t "prof rc=$?"; grep "^##" $L/prof.log
git apply .devnext/flush.patch && t "flush applied"
timeout 180 python bench.py gemm > $L/gemm_flush.log 2>&1; t "gemm rc=$?"
grep "| 1 |\|| 16 |" $L/gemm_flush.log | head -8 | cut -c1-120
git checkout rac.py
