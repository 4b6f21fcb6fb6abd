#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
timeout 230 python -m pytest -q -m cuda tests/test_moe.py tests/test_rollout.py tests/test_fp8.py tests/test_rac.py -k "not every_gpu_config" > $L/tests.log 2>&1; t "tests rc=$?"; tail -3 $L/tests.log
timeout 120 python .devnext/fused_check.py > $L/fused_check.log 2>&1; t "check rc=$?"; grep -v Warn $L/fused_check.log | tail -12
for r in 1 2; do timeout 80 python bench.py decode > $L/decode_run$r.log 2>&1; t "decode $r rc=$?"; grep "rac\|moe.py" $L/decode_run$r.log | head -20 | cut -c1-90; done
timeout 90 python .devnext/prof_decode.py > $L/prof.log 2>&1; t "prof rc=$?"; grep "^##" $L/prof.log
