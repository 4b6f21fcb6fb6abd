#!/bin/bash
# Session 10, call C: branch quads (four-plane operand, 16-bit weight words) on the GPU: real-shape and tiny-shape
# kernel tests, decode, profile.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
P="python -m pytest -p no:cacheprovider -v --tb=short"
timeout 150 $P -m cuda tests/test_rac.py > $L/tests_quads_cuda.log 2>&1; t "cuda tests rc=$?"
grep -E "FAILED|passed|failed" $L/tests_quads_cuda.log | tail -6
timeout 200 $P -x tests/test_rac.py -k "quantizer or prefill or dense_kernel_matches or split_k" > $L/tests_quads_dense.log 2>&1
t "dense tiny tests rc=$?"; grep -E "FAILED|passed|failed|Error" $L/tests_quads_dense.log | tail -6
timeout 80 python bench.py decode > $L/decode_quads_run1.log 2>&1; t "decode rc=$?"; grep "| rac \|_kernel" $L/decode_quads_run1.log | cut -c1-120
timeout 80 python .devnext/prof_decode.py > $L/prof_quads.log 2>&1; t "prof rc=$?"; grep "^##\|_grouped\|_dense\|_quantize" $L/prof_quads.log
