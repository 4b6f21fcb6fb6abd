#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
timeout 150 python -m pytest -q -m cuda tests/test_qat.py tests/test_nvfp4.py > $L/tests_qat_nvfp4.log 2>&1; t "tests rc=$?"; tail -2 $L/tests_qat_nvfp4.log
for r in bf16 quads; do timeout 130 python train.py --recipe $r --steps 10 --warmstart-steps 0 --eval-every 10 --out-dir /tmp/runs > $L/train_$r.log 2>&1; t "train $r rc=$?"; done
python - > $L/mismatch.log 2>&1 <<'PY'
import json
for r in ("bf16", "quads"):
    rows = [json.loads(l) for l in open(f"/tmp/runs/{r}/metrics.jsonl") if '"mismatch/abs_diff_mean"' in l]
    print(r, [f"{x['mismatch/abs_diff_mean']:.2e}" for x in rows])
PY
cat $L/mismatch.log
timeout 150 python -c "import bench; bench._bench_rollout_vs_hf()" > $L/rollout_vs_hf.log 2>&1; t "hf rc=$?"; tail -8 $L/rollout_vs_hf.log
