#!/bin/bash
# Session 10, call G: bench.py decode with rates from the fastest of 5 calls, twice; every call's time logged.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
for r in 1 2; do
  timeout 115 python - > $L/decode_min_run$r.log 2>&1 <<'PY'
import time, torch, bench, rac, rollout
orig = rollout.generate
def timed(model, prompts, *a, **k):
    torch.cuda.synchronize(); t0 = time.perf_counter(); out = orig(model, prompts, *a, **k); torch.cuda.synchronize()
    print(f"@@ batch {len(prompts)} new {a[1] if len(a) > 1 else k.get('max_new_tokens')} {time.perf_counter() - t0:.4f}", flush=True)
    return out
rollout.generate = timed
print(bench.gpu_header())
bench._bench_decode_per_precision(rac)
PY
  t "decode $r rc=$?"; grep "| rac " $L/decode_min_run$r.log | cut -c1-100
done
