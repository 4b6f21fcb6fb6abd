#!/bin/bash
# Session 11, call D: branch decode-replay (swiglu-helpers + bench decode timed from graph replays): bench decode x2.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
for r in 1 2; do timeout 150 python bench.py decode > $L/decode_replay_run$r.log 2>&1; t "decode $r rc=$?"; grep "| rac \|moe.py" $L/decode_replay_run$r.log | cut -c1-120; done
