#!/bin/bash
# Session 10, call F: why does a decode variant's step at batch 256 take 1.72 or 1.87 ms run to run?
# bench.py decode twice with the SM clock, power and throttle reasons sampled every 50 ms.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active,utilization.gpu --format=csv -lms 50 > $L/smi.csv 2>&1 &
SMI=$!
for r in 1 2; do
  python - > $L/decode_clock_run$r.log 2>&1 <<'PY'
import time, sys, bench, rac
orig = bench._time_generate
def timed(model, prompts, samples, new):
    t0 = time.time(); out = orig(model, prompts, samples, new)
    print(f"@@ {time.time():.3f} start {t0:.3f} batch {len(prompts)} new {new} t {out[0]:.4f}", flush=True)
    return out
bench._time_generate = timed
print(bench.gpu_header())
bench._bench_decode_per_precision(rac)
PY
  t "decode $r rc=$?"; grep "| rac \|@@" $L/decode_clock_run$r.log | cut -c1-100 | tail -24
done
kill $SMI
