#!/bin/bash
# stacked q/k/v GEMM: every CUDA test, bench.py decode twice, bench.py gemm
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
START=$(date +%s); L=/tmp/logs; mkdir -p $L
t() { echo "$1 $(( $(date +%s) - START ))s" >> $L/times.log; tar czf $OUT/logs.tgz -C $L . 2>/dev/null; }
python -c "import datasets" 2>/dev/null && IGN="" || IGN="--ignore=tests/test_train.py --ignore=tests/test_tasks.py"
timeout 290 python -m pytest -q -m cuda -rf --durations=5 tests $IGN > $L/tests.log 2>&1; t "tests rc=$?"
for i in 1 2; do timeout 100 python bench.py decode > $L/decode$i.log 2>&1; t "decode$i rc=$?"; done
timeout $(( 585 - ($(date +%s) - START) )) python bench.py gemm > $L/gemm.log 2>&1; t "gemm rc=$?"
cat $L/times.log; tail -4 $L/tests.log; for i in 1 2; do grep -A11 "^| rollout layers" $L/decode$i.log; done
grep -B1 -A22 "### Dense projections, decode" $L/gemm.log | cut -c1-200
