#!/bin/bash
# Session 11, call A: branch adaptive-tiles (grouped kernel: 32-row tiles whose short ones run as 16-row tiles).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $L/env.log
timeout 200 python .devnext/experts_tiles.py 64 256 > $L/experts_tiles.log 2>&1; t "experts rc=$?"
cat $L/experts_tiles.log
timeout 150 python -m pytest -q -m cuda tests/test_rac.py -k "grouped or experts" > $L/tests_grouped.log 2>&1; t "tests rc=$?"
tail -3 $L/tests_grouped.log
git apply .devnext/decode_min_bench.patch && t "decode-min applied"
timeout 130 python - > $L/decode_run1.log 2>&1 <<'PY'
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
t "decode rc=$?"; grep "| rac \|moe.py" $L/decode_run1.log | cut -c1-120
git checkout bench.py
