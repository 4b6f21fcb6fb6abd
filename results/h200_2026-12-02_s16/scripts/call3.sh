export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P="python -m pytest -q -p no:cacheprovider"
timeout 200 $P -m cuda tests/test_rac.py -k "grouped or experts or gluon or pdl or qwen3" > $OUT/tests_grouped.log 2>&1 &
timeout 200 $P tests/test_rac.py -k "every_gpu_config" > $OUT/tests_every_config.log 2>&1 &
wait
for f in $OUT/tests_*.log; do echo "== $f"; tail -2 $f; done
grep -E "^FAILED|Error" $OUT/tests_*.log | head -20
timeout 150 python bench.py gemm > $OUT/gemm.log 2>&1
grep "^| 64 \|^| 256 \|^| q_proj\|GEMMs alone\|autotun" $OUT/gemm.log | head -30 | cut -c1-240
timeout 150 python bench.py decode > $OUT/decode.log 2>&1
grep "| rac\|moe.py\|ratio\|x |" $OUT/decode.log | head -20
