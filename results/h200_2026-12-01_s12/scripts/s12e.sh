#!/bin/bash
export PYTHONUNBUFFERED=1; L=$OUT
PYTHONPATH=$PWD timeout 200 python .devnext/amax_probe.py > $L/amax_probe.log 2>&1; echo "rc=$?"
(cd .devnext/c2bad1a && PYTHONPATH=$PWD timeout 100 python ../amax_old.py) > $L/amax_old.log 2>&1; echo "rc=$?"
cat $L/amax_probe.log $L/amax_old.log
