export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python -m pytest -q -x tests/test_rac.py -k "grouped or every_gpu or experts or gluon" -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/tests.log
timeout 330 python .devnext/s20/experts_variants.py 2>&1 | tee $OUT/experts_variants.log
