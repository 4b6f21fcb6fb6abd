#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
timeout 150 python -m pytest -q -m cuda tests/test_moe.py tests/test_rollout.py tests/test_qat.py > $L/tests.log 2>&1; t "tests rc=$?"; grep -i "passed\|failed\|error" $L/tests.log | tail -5
for r in bf16 quads; do timeout 100 python train.py --recipe $r --steps 10 --warmstart-steps 0 --eval-every 10 --out-dir /tmp/runs > $L/train_$r.log 2>&1; t "train $r rc=$?"; done
python - > $L/mismatch.log 2>&1 <<'PY'
import json
for r in ("bf16", "quads"):
    rows = [json.loads(l) for l in open(f"/tmp/runs/{r}/metrics.jsonl") if '"mismatch/abs_diff_mean"' in l]
    print(r, "mismatch/abs_diff_mean", [f"{x['mismatch/abs_diff_mean']:.2e}" for x in rows])
    print(r, "routing", [f"{x.get('routing_disagreement', float('nan')):.2e}" for x in rows])
PY
cat $L/mismatch.log
timeout 80 python bench.py decode > $L/decode_final.log 2>&1; t "decode rc=$?"; grep "rac\|moe.py" $L/decode_final.log | head -20 | cut -c1-90
