#!/bin/bash
# Session 12, call A: grouped configurations with 8 (and 2) warps, forced one at a time.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/env.log
timeout 400 python .devnext/experts_w8.py 64 256 > $L/experts_w8.log 2>&1; echo "experts rc=$? $(( $(date +%s) - START ))s"
cut -c1-140 $L/experts_w8.log
