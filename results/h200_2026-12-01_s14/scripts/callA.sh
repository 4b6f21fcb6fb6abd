export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
T=tests/test_rac.py
EC=$T::test_every_gpu_config_is_deterministic_and_matches_the_twin
S=$(date +%s)
timeout 380 python -m pytest -q -p no:cacheprovider $T -k "grouped or experts" --deselect $EC > $OUT/tests_rac_grouped.log 2>&1 &
timeout 380 python -m pytest -q -p no:cacheprovider $T -k "dense or split or stacked or prefill or q_k_v" > $OUT/tests_rac_dense.log 2>&1 &
timeout 380 python -m pytest -q -p no:cacheprovider $T -k "not (grouped or experts or dense or split or stacked or prefill or q_k_v or every_gpu_config)" > $OUT/tests_rac_rest.log 2>&1 &
timeout 380 python -m pytest -q -p no:cacheprovider $EC > $OUT/tests_every_config.log 2>&1 &
timeout 300 python -m pytest -q -p no:cacheprovider -m cuda tests/test_rollout.py > $OUT/tests_rollout_cuda.log 2>&1 &
wait
echo "tests wall $(( $(date +%s) - S )) s" > $OUT/tests_wall.txt
for f in $OUT/tests_*.log; do echo "$f: $(tail -1 $f)"; done
timeout 100 python bench.py decode > $OUT/decode_run1.log 2>&1
timeout 100 python bench.py decode > $OUT/decode_run2.log 2>&1
grep -A8 "ms / decode step |" $OUT/decode_run1.log | head -12
grep -A8 "ms / decode step |" $OUT/decode_run2.log | head -12
grep "nvfp4 vs\|vs bf16\|vs fp8\|RAC" $OUT/decode_run*.log | head -20
