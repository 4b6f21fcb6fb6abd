#!/bin/bash
# Tests after the config change + greedy tokens (fused norm and torch norm) + the old tree's bf16 mismatch.
export PYTHONUNBUFFERED=1; ROOT=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
PYTHONPATH=$ROOT timeout 300 python -m pytest -q -m cuda tests/test_rac.py tests/test_nvfp4.py tests/test_fp8.py tests/test_rollout.py > $L/tests.log 2>&1; t "tests rc=$?"
tail -3 $L/tests.log
PYTHONPATH=$ROOT timeout 100 python .devnext/greedy_gap.py > $L/greedy_gap.log 2>&1; t "greedy rc=$?"
grep -v Warn $L/greedy_gap.log | tail -3
(cd .devnext/prev && PYTHONPATH=$ROOT/.devnext/prev timeout 100 python train.py --recipe bf16 --steps 10 --warmstart-steps 0 --eval-every 10 --out-dir /tmp/runs_old > $L/train_bf16_old.log 2>&1); t "train old rc=$?"
python - <<'PY' | tee $L/mismatch_old.log
import json
rows = [json.loads(l) for l in open("/tmp/runs_old/bf16/metrics.jsonl") if '"mismatch/abs_diff_mean"' in l]
print("bf16 old", [f"{x['mismatch/abs_diff_mean']:.2e}" for x in rows])
PY
