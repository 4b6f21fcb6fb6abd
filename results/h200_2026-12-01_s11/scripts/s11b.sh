#!/bin/bash
# Session 11, call B: branch swiglu-helpers: grouped CUDA tests; bench decode with decode-min (run 2);
# ncu stall reasons of the grouped gate/up kernel at 256 tokens.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
timeout 150 python -m pytest -q -m cuda tests/test_rac.py -k "grouped or experts or native" > $L/tests_grouped.log 2>&1; t "tests rc=$?"
tail -3 $L/tests_grouped.log
git apply .devnext/decode_min_bench.patch && t "decode-min applied"
timeout 130 python - > $L/decode_run2.log 2>&1 <<'PY'
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
t "decode rc=$?"; grep "| rac \|moe.py" $L/decode_run2.log | cut -c1-120
git checkout bench.py
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for tg in grouped_gu grouped_dn; do
timeout 120 $NCU --clock-control none --launch-skip 3 --launch-count 1 -k regex:_grouped_kernel \
  --section WarpStateStats --section SchedulerStats --section Occupancy \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,regex:sm__pipe_.*_cycles_active\\.avg\\.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*\\.avg\\.pct_of_peak_sustained_active \
  python .devnext/ncu_target.py $tg > $L/ncu_stalls_$tg.txt 2>&1; t "ncu $tg rc=$?"
grep -E "stalled" $L/ncu_stalls_$tg.txt | sort -k3 -n -r | head -12
done
