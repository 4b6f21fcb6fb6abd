#!/bin/bash
# Session 10, call E: main (kernel-helpers + tile-prologue merged): bench decode x2, bench gemm.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
for r in 1 2; do timeout 90 python bench.py decode > $L/decode_main_run$r.log 2>&1; t "decode $r rc=$?"; grep "| rac " $L/decode_main_run$r.log | cut -c1-90; done
timeout 240 python bench.py gemm > $L/gemm_main.log 2>&1; t "gemm rc=$?"
grep -A4 "### Expert" $L/gemm_main.log | cut -c1-200; grep "| 1 |\|4096 |" $L/gemm_main.log | cut -c1-150 | head -12
