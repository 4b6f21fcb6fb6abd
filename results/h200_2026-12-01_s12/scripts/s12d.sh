#!/bin/bash
export PYTHONUNBUFFERED=1; L=$OUT; START=$(date +%s)
for tree in c2bad1a main c2bad1a main; do
  if [ $tree = main ]; then P=$PWD; else P=$PWD/.devnext/c2bad1a; fi
  (cd $P && PYTHONPATH=$P timeout 150 python $OLDPWD/.devnext/prefill_parts.py) >> $L/prefill_parts.log 2>&1
  echo "rc=$? $(( $(date +%s) - START ))s"
done
cat $L/prefill_parts.log
