export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
P="python -m pytest -q -p no:cacheprovider -m cuda"
timeout 200 $P tests/test_rac.py -k "grouped or experts or gluon or pdl or qwen3" > $OUT/tests_grouped.log 2>&1 &
timeout 200 $P tests/test_rac.py -k "every_gpu_config" > $OUT/tests_every_config.log 2>&1 &
timeout 200 $P tests/test_rollout.py > $OUT/tests_rollout_cuda.log 2>&1 &
wait
tail -3 $OUT/tests_grouped.log; tail -3 $OUT/tests_every_config.log; tail -3 $OUT/tests_rollout_cuda.log
grep -E "FAIL|Error" $OUT/tests_*.log | head -20
timeout 150 python bench.py decode > $OUT/decode.log 2>&1
grep "| rac\|moe.py\|ratio\|x |" $OUT/decode.log | head -20
timeout 135 python bench.py gemm > $OUT/gemm.log 2>&1
grep "^| 64 \|^| 256 \|^| q_proj\|^| o_proj" $OUT/gemm.log | head -20 | cut -c1-220
