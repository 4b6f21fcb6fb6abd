# Session 17 call 3: wgmma prototype (A registers safe: wait 0 a step), then GPU tests of main 29e8a9f
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python .devnext/s17/wg_gpu.py > $OUT/wg_sync.log 2>&1; grep -v "^\s*$" $OUT/wg_sync.log | cut -c1-200
P="python -m pytest -q -p no:cacheprovider"
timeout 330 $P tests/test_rac.py -k "not every_gpu_config and (test_dense_kernel_matches_the_layer_twin or stacked)" > $OUT/t_dense_a.log 2>&1 &
timeout 330 $P tests/test_rac.py -k "not every_gpu_config and not test_dense_kernel_matches_the_layer_twin and not stacked and (dense or quantizer or fused or split or prefill or partial)" > $OUT/t_dense_b.log 2>&1 &
timeout 330 $P tests/test_rac.py -k "every_gpu_config" > $OUT/t_every.log 2>&1 &
timeout 330 $P -m cuda tests/test_rac.py -k "grouped or experts or gluon or pdl or qwen3" > $OUT/t_grouped.log 2>&1 &
wait
for f in $OUT/t_*.log; do echo "== $f"; tail -1 $f; done
grep -E "^FAILED|^ERROR" $OUT/t_*.log | head -20
