#!/bin/bash
# Session 12, call B: the grouped kernel with stages dropped (no code decode, no block scales, neither).
export PYTHONUNBUFFERED=1; L=$OUT; START=$(date +%s)
for v in ${VARIANTS:-v0 v1 v2 v3}; do
  if [ $v = v0 ]; then P=$PWD; else P=$PWD/.devnext/$v; fi
  echo "== $v" | tee -a $L/experts_drop.log
  PYTHONPATH=$P:$PWD timeout 120 python .devnext/experts_drop.py >> $L/experts_drop.log 2>&1; echo "rc=$? $(( $(date +%s) - START ))s"
done
cat $L/experts_drop.log
