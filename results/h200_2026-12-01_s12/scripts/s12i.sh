#!/bin/bash
# Session 12, call I: the fused sum of expert rows: equality with the expression it replaces, its tests and the
# rollout's CUDA tests on the GPU, then bench.py decode.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
timeout 60 python .devnext/sum_check.py > $L/sum_check.log 2>&1; echo "check rc=$? $(( $(date +%s) - START ))s"; cat $L/sum_check.log
timeout 90 python -m pytest -q -p no:cacheprovider tests/test_moe.py tests/test_rac.py -k "sum_expert_rows or sum_of_expert or nvfp4_experts_fast_path" > $L/tests_sum.log 2>&1
echo "sum tests rc=$? $(( $(date +%s) - START ))s"; tail -2 $L/tests_sum.log
timeout 120 python -m pytest -q -p no:cacheprovider -m cuda tests/test_rollout.py > $L/tests_rollout_cuda.log 2>&1
echo "rollout cuda tests rc=$? $(( $(date +%s) - START ))s"; tail -2 $L/tests_rollout_cuda.log
timeout 130 python bench.py decode > $L/decode.log 2>&1; echo "decode rc=$? $(( $(date +%s) - START ))s"
grep "| rac \|moe.py\|^|" $L/decode.log | head -20
