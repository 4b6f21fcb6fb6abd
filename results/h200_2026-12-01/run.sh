#!/bin/bash
# The final device call: CUDA tests, the audit, torchrun vs python, decode and QAT benchmarks; logs under $OUT.
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p $TRITON_CACHE_DIR && tar xzf .devfinal/cache.tgz -C $TRITON_CACHE_DIR 2>/dev/null
START=$(date +%s)
L=/tmp/logs; mkdir -p $L
t() { echo "$1 $(( $(date +%s) - START ))s" >> $L/times.log; tar czf $OUT/logs.tgz -C $L . 2>/dev/null; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $L/env.log
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $L/env.log
git log --oneline -1 >> $L/env.log 2>&1
# A (background): a short default-preset quads run, then the three-way audit of its checkpoint
( timeout 300 python train.py --recipe quads --steps 10 --eval-every 10 --warmstart-steps 300 --eval-prompts 64 \
    --out-dir /tmp/ra > $L/audit.log 2>&1 && t "A-run" && \
  timeout 120 python train.py --audit /tmp/ra/quads --audit-recipes bf16,fp8,nvfp4,quads >> $L/audit.log 2>&1; \
  t "A-audit"; cp /tmp/ra/quads/audit.md /tmp/ra/quads/audit.json $L/ 2>/dev/null ) &
A=$!
# B (background): python train.py against torchrun --nproc_per_node=1 (NCCL), same settings and warm-start
( W="--recipe bf16 --steps 3 --eval-every 3 --warmstart-steps 200 --eval-prompts 64 --prompts-per-step 16"
  timeout 200 python train.py $W --out-dir /tmp/rb1 > $L/torchrun.log 2>&1; t "B-python"
  mkdir -p /tmp/rb2 && cp -r /tmp/rb1/warmstart /tmp/rb2/
  timeout 150 torchrun --standalone --nproc_per_node=1 train.py $W --out-dir /tmp/rb2 >> $L/torchrun.log 2>&1
  echo "torchrun rc=$?" >> $L/torchrun.log; t "B-torchrun"
  python - >> $L/torchrun.log 2>&1 <<'PY'
import json, torch
a = [json.loads(l) for l in open("/tmp/rb1/bf16/metrics.jsonl")]
b = [json.loads(l) for l in open("/tmp/rb2/bf16/metrics.jsonl")]
keys = ("reward", "loss", "grad_norm", "pass@1", "pass@1_bf16_trainer", "mismatch/abs_diff_mean")
for x, y in zip(a, b):
    print("step", x["step"], {k: (x[k], y[k]) for k in keys if k in x})
ca, cb = torch.load("/tmp/rb1/bf16/checkpoint.pt"), torch.load("/tmp/rb2/bf16/checkpoint.pt")
print("max |weight diff| python vs torchrun:", max((ca["trainer"][k].float() - cb["trainer"][k].float()).abs().max().item()
                                               for k in ca["trainer"]))
PY
) &
B=$!
# C (foreground, meanwhile): every CUDA test
timeout 230 python -m pytest -q -m cuda -rf tests > $L/tests.log 2>&1; t "C-tests rc=$?"
wait $A $B
# D, E: benchmarks alone on the GPU
timeout 150 python bench.py decode > $L/decode.log 2>&1; t "D-decode rc=$?"
timeout 100 python bench.py qat > $L/qat.log 2>&1; t "E-qat rc=$?"
# F: trace's eager, recording rollout against nvfp4's graph rollout, if time is left
if [ $(( $(date +%s) - START )) -lt 430 ]; then
  mkdir -p /tmp/rf && cp -r /tmp/ra/warmstart /tmp/rf/ 2>/dev/null
  timeout $(( 540 - ($(date +%s) - START) )) python train.py --compare nvfp4,trace --steps 20 --eval-every 20 \
    --warmstart-steps 300 --eval-prompts 64 --out-dir /tmp/rf > $L/trace.log 2>&1; t "F-trace rc=$?"
  cp /tmp/rf/compare_*.md $L/ 2>/dev/null
fi
t "end"
cat $L/times.log $L/env.log; tail -4 $L/tests.log; tail -12 $L/audit.md 2>/dev/null; tail -6 $L/torchrun.log
tail -22 $L/decode.log; tail -14 $L/qat.log; tail -5 $L/trace.log 2>/dev/null | cut -c1-300
