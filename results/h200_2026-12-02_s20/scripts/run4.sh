export PYTHONPATH=$PWD
timeout 250 python .devnext/s20/prefetch.py 2>&1 | tee $OUT/prefetch.log
timeout 120 python -m pytest -q tests/test_rac.py -k "short_tiles or qwen3_expert" -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/tests_prefetch.log
