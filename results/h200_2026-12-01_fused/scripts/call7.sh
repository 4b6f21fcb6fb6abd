#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT
timeout 120 python - > $L/train_bf16_torch_router.log 2>&1 <<'PY'
import moe
moe.router_top_k = lambda logits, a, n, routes=None: moe.router_top_k_reference(logits, a, n, routes)
import train
train.main(["--recipe", "bf16", "--steps", "10", "--warmstart-steps", "0", "--eval-every", "10", "--out-dir", "/tmp/runs_ref"])
PY
echo "rc=$?"
python - <<'PY' | tee $L/mismatch_torch_router.log
import json
rows = [json.loads(l) for l in open("/tmp/runs_ref/bf16/metrics.jsonl") if '"mismatch/abs_diff_mean"' in l]
print("bf16 torch router mismatch/abs_diff_mean", [f"{x['mismatch/abs_diff_mean']:.2e}" for x in rows])
print("bf16 torch router routing", [f"{x.get('routing_disagreement', float('nan')):.2e}" for x in rows])
PY
