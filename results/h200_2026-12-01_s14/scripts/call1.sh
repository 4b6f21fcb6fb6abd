export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python .devnext/s14/pdl_gpu.py 2>&1 | grep -v Warning | tee $OUT/pdl.log
timeout 240 python -m pytest -q -m cuda tests/test_rollout.py 2>&1 | tail -3 | tee $OUT/tests_rollout_pdl.log
