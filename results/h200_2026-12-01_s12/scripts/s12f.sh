#!/bin/bash
export PYTHONUNBUFFERED=1; L=$OUT
PYTHONPATH=$PWD timeout 300 python .devnext/partial_probe.py > $L/partial_probe.log 2>&1; echo "rc=$?"
cat $L/partial_probe.log
