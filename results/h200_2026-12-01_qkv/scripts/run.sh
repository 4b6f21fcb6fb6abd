#!/bin/bash
# next-decode (main + qkv-shared-input + fused-rmsnorm): every CUDA test, then bench.py decode on it and on
# main (ac1860e, in .devnext/base) alternately; logs under $OUT/logs.tgz.
export PYTHONUNBUFFERED=1
START=$(date +%s); L=/tmp/logs; mkdir -p $L; ROOT=$PWD
t() { echo "$1 $(( $(date +%s) - START ))s" >> $L/times.log; tar czf $OUT/logs.tgz -C $L . 2>/dev/null; }
python -c "import datasets" 2>/dev/null && IGN="" || IGN="--ignore=tests/test_train.py --ignore=tests/test_tasks.py"
PYTHONPATH=$ROOT timeout 280 python -m pytest -q -m cuda -rf --durations=8 tests $IGN \
  --deselect tests/test_rac.py::test_every_gpu_config_is_deterministic_and_matches_the_twin > $L/tests.log 2>&1; t "tests rc=$?"
for i in 1 2; do
  (cd $ROOT && PYTHONPATH=$ROOT timeout 100 python bench.py decode > $L/new$i.log 2>&1); t "new$i rc=$?"
  (cd $ROOT/.devnext/base && PYTHONPATH=$ROOT/.devnext/base timeout 100 python bench.py decode > $L/base$i.log 2>&1); t "base$i rc=$?"
done
cat $L/times.log; tail -4 $L/tests.log; for f in new1 base1 new2 base2; do echo "== $f"; tail -14 $L/$f.log; done
