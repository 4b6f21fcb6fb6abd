#!/bin/bash
# Session 12, call G: rac's tests on the GPU (all but the every-config one), then prefill vs c2bad1a in one harness.
export PYTHONUNBUFFERED=1; L=$OUT; START=$(date +%s)
timeout 330 python -m pytest -q tests/test_rac.py -k "not every_config" -p no:cacheprovider > $L/tests_rac.log 2>&1
echo "tests rc=$? $(( $(date +%s) - START ))s"; tail -3 $L/tests_rac.log
for tree in c2bad1a main c2bad1a main; do
  if [ $tree = main ]; then P=$PWD; else P=$PWD/.devnext/c2bad1a; fi
  echo "== tree $tree" >> $L/prefill_ab.log
  (cd $P && PYTHONPATH=$P timeout 100 python $OLDPWD/.devnext/prefill_ab.py) >> $L/prefill_ab.log 2>&1
  echo "rc=$? $(( $(date +%s) - START ))s"
done
grep -v pick $L/prefill_ab.log
