#!/bin/bash
# For the next session (about 4 minutes): (1) greedy nvfp4 + RAC 0.5 tokens on a fixed model, main
# against ac1860e (before the fused RMSNorm, the shared q/k/v quantization and the stacked q/k/v GEMM);
# (2) the bf16 and quads recipes' train/rollout mismatch after the fused RMSNorm (no warm-start, 10 steps);
# (3) every CUDA test of test_train/test_qat/test_moe (qat's guided_values and moe's routes changed, CPU-tested).
export PYTHONUNBUFFERED=1
START=$(date +%s); L=/tmp/logs; mkdir -p $L; ROOT=$PWD
t() { echo "$1 $(( $(date +%s) - START ))s" >> $L/times.log; tar czf $OUT/logs.tgz -C $L . 2>/dev/null; }
PYTHONPATH=$ROOT timeout 120 python .devnext/greedy.py $L/new.pt > $L/greedy_new.log 2>&1; t "greedy new rc=$?"
(cd .devnext/prev && PYTHONPATH=$ROOT/.devnext/prev timeout 120 python $ROOT/.devnext/greedy.py $L/old.pt > $L/greedy_old.log 2>&1); t "greedy old rc=$?"
python -c "import torch; a, b = torch.load('$L/new.pt'), torch.load('$L/old.pt'); print('greedy tokens equal:', (a == b).float().mean().item(), 'rows identical:', (a == b).all(1).float().mean().item())" > $L/greedy.log 2>&1
for r in bf16 quads; do PYTHONPATH=$ROOT timeout 150 python train.py --recipe $r --steps 10 --warmstart-steps 0 --eval-every 10 --out-dir /tmp/runs > $L/train_$r.log 2>&1; t "train $r rc=$?"; done
python - >> $L/mismatch.log 2>&1 <<'PY'
import json
for r in ("bf16", "quads"):
    rows = [json.loads(l) for l in open(f"/tmp/runs/{r}/metrics.jsonl") if '"mismatch/abs_diff_mean"' in l]
    print(r, [f"{x['mismatch/abs_diff_mean']:.2e}" for x in rows])
PY
PYTHONPATH=$ROOT timeout 200 python -m pytest -q -m cuda tests/test_qat.py tests/test_moe.py tests/test_rollout.py > $L/tests.log 2>&1; t "tests rc=$?"
cat $L/times.log $L/greedy.log $L/mismatch.log; tail -3 $L/tests.log
