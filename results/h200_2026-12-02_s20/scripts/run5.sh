export PYTHONPATH=$PWD
git log --oneline -1 2>/dev/null
RAC=rac PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --print-limit 5 python .devnext/s20/sanitize.py 2>&1 | tail -12 > $OUT/memcheck_main.log
tail -4 $OUT/memcheck_main.log
timeout 400 python -m pytest -q -m cuda tests/ -p no:cacheprovider 2>&1 | tail -8 | tee $OUT/tests_cuda_all.log
