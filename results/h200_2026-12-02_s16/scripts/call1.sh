export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
P="python -m pytest -q -p no:cacheprovider"
timeout 330 $P tests/test_rac.py > $OUT/tests_rac_full.log 2>&1 &
timeout 330 $P tests/test_moe.py tests/test_nvfp4.py tests/test_fp8.py > $OUT/tests_moe_nvfp4_fp8.log 2>&1 &
timeout 330 $P -m cuda tests/test_rollout.py tests/test_qat.py > $OUT/tests_rollout_qat_cuda.log 2>&1 &
wait
for f in $OUT/tests_*.log; do echo "== $f"; tail -3 $f; done
grep -E "^FAILED|Error" $OUT/tests_*.log | head -20
timeout 240 python .devnext/s16/gd_gpu.py > $OUT/gd_gpu.log 2>&1
cat $OUT/gd_gpu.log | cut -c1-200
