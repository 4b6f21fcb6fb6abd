#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
START=$(date +%s); L=/tmp/logs; mkdir -p $L
t() { echo "$1 $(( $(date +%s) - START ))s" >> $L/times.log; tar czf $OUT/logs.tgz -C $L . 2>/dev/null; }
timeout 120 python .devnext/gemv.py > $L/gemv_new.log 2>&1; t "gemv new rc=$?"
RAC_EXP_GEMV_OLD=1 timeout 120 python .devnext/gemv.py > $L/gemv_old.log 2>&1; t "gemv old rc=$?"
timeout 120 python -m pytest -q -m cuda tests/test_rac.py -k "dense and gpu" > $L/tests.log 2>&1; t "tests rc=$?"
timeout 150 python .devnext/prof256.py > $L/prof256.log 2>&1; t "prof rc=$?"
cat $L/times.log; cat $L/gemv_new.log $L/gemv_old.log | grep -v Warn; tail -2 $L/tests.log; cat $L/prof256.log | grep -v Warn
