#!/bin/bash
# final: the every-config test and the stacked/shared tests, bench.py gemm, bench.py decode
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
START=$(date +%s); L=/tmp/logs; mkdir -p $L
t() { echo "$1 $(( $(date +%s) - START ))s" >> $L/times.log; tar czf $OUT/logs.tgz -C $L . 2>/dev/null; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $L/env.log
timeout 200 python -m pytest -q -m cuda -rf tests/test_rac.py -k "every_gpu_config or q_k_v or dense" > $L/tests.log 2>&1; t "tests rc=$?"
timeout 150 python bench.py gemm > $L/gemm.log 2>&1; t "gemm rc=$?"
timeout $(( 420 - ($(date +%s) - START) )) python bench.py decode > $L/decode.log 2>&1; t "decode rc=$?"
cat $L/times.log; tail -3 $L/tests.log; grep -A11 "^| rollout layers" $L/decode.log; grep -A14 "speed ratio at batch 64" $L/decode.log
grep -A22 "### Decode layer variants" $L/gemm.log | grep "256" | cut -c1-400; grep -A12 "### Dense projections, prefill" $L/gemm.log; grep -A30 "autotuned configs" $L/gemm.log
