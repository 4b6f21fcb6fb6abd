#!/bin/bash
# Session 10, call A: kernel-helpers branch on the GPU; cuda tests of rollout/qat/fp8 on main; decode with configs.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $L/env.log; python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $L/env.log
P="python -m pytest -p no:cacheprovider -v --tb=short"
timeout 170 $P -m cuda tests/test_rollout.py tests/test_qat.py tests/test_fp8.py > $L/tests_cuda_rollout_qat_fp8.log 2>&1; t "cuda tests main rc=$?"
grep -E "FAILED|passed|failed" $L/tests_cuda_rollout_qat_fp8.log | tail -6
timeout 80 python bench.py decode > $L/decode_main.log 2>&1; t "decode main rc=$?"; grep "| rac \|config\|BLOCK" $L/decode_main.log | cut -c1-120 | head -30
git apply .devnext/kernel_helpers.patch && t "kernel-helpers applied"
timeout 150 $P tests/test_moe.py tests/test_rollout.py -k "norm or rout or noise or sampler or fused" > $L/tests_kernel_helpers.log 2>&1; t "tests rc=$?"
grep -E "FAILED|passed|failed" $L/tests_kernel_helpers.log | tail -6
timeout 120 python .devnext/fused_check.py "norm_rope twin" "routing twin" "sampler twin" > $L/fused_check_helpers.log 2>&1
t "check rc=$?"; grep -v Warn $L/fused_check_helpers.log | tail -12
git checkout moe.py rollout.py
