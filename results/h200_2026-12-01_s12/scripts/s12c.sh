#!/bin/bash
# Session 12, call C: prefill layer times of c2bad1a's tree and main's in one harness, alternating.
export PYTHONUNBUFFERED=1; L=$OUT; START=$(date +%s)
for round in 1; do
  for tree in c2bad1a main; do
    if [ $tree = main ]; then P=$PWD; else P=$PWD/.devnext/c2bad1a; fi
    echo "== round $round tree $tree" >> $L/prefill_ab.log
    (cd $P && PYTHONPATH=$P timeout 150 python $OLDPWD/.devnext/prefill_ab.py force) >> $L/prefill_ab.log 2>&1
    echo "rc=$? $(( $(date +%s) - START ))s"
  done
done
cat $L/prefill_ab.log
