#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
timeout 150 python -m pytest -q -m cuda tests/test_moe.py tests/test_rollout.py -k "not rac_rollout_layers" > $L/tests.log 2>&1; t "tests rc=$?"; grep -i "passed\|failed\|error" $L/tests.log | tail -5
timeout 100 python .devnext/fused_check.py "router twin" > $L/fused_check_router.log 2>&1; t "check rc=$?"; grep -v Warn $L/fused_check_router.log | tail -5
for r in 1 2; do timeout 80 python bench.py decode > $L/decode_run$r.log 2>&1; t "decode $r rc=$?"; grep "rac\|moe.py" $L/decode_run$r.log | head -20 | cut -c1-90; done
timeout 80 python .devnext/prof_decode.py > $L/prof.log 2>&1; t "prof rc=$?"; grep "^##" $L/prof.log
