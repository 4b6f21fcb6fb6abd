# Session 17 call 1: main's GPU tests not yet run since db77f63 (4 processes), then the experts A/B vs branch.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
P="python -m pytest -q -p no:cacheprovider"
timeout 320 $P tests/test_rac.py -k "every_gpu_config" > $OUT/t_every.log 2>&1 &
timeout 320 $P tests/test_rac.py -k "not every_gpu_config and (dense or stacked or quantizer or fused or split or prefill or partial)" > $OUT/t_dense.log 2>&1 &
timeout 320 $P tests/test_rac.py -k "not every_gpu_config and not (dense or stacked or quantizer or fused or split or prefill or partial)" > $OUT/t_rest.log 2>&1 &
timeout 320 $P -m cuda tests/test_rollout.py tests/test_qat.py tests/test_moe.py > $OUT/t_cuda_other.log 2>&1 &
wait
for f in $OUT/t_*.log; do echo "== $f"; tail -2 $f; done
grep -E "^FAILED|^ERROR" $OUT/t_*.log | head -20
timeout 200 python .devnext/s17/experts_ab.py .devnext/s17/rac_branch.py branch > $OUT/experts_ab.log 2>&1
cat $OUT/experts_ab.log | tail -5
