#!/bin/bash
# Session 10, call D: quads with 16-bit block scales (a per-call int16 copy: a timing probe of the kernels only).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
cp .devnext/rac_s16.py rac.py
timeout 90 python .devnext/prof_decode.py > $L/prof_s16.log 2>&1; t "prof rc=$?"; grep "^##\|_grouped\|_dense\|_quantize" $L/prof_s16.log
timeout 90 python bench.py decode > $L/decode_s16.log 2>&1; t "decode rc=$?"; grep "| rac \|_kernel" $L/decode_s16.log | cut -c1-120
git checkout rac.py
