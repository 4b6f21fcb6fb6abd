# Session 17 call 5: a bucket of 8 rows an expert (16-row tile candidates) for the experts' Gluon kernel
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 170 python .devnext/s17/experts_ab2.py .devnext/s17/rac_before_b8.py before rac.py after > $OUT/experts_bucket8_ab.log 2>&1
cat $OUT/experts_bucket8_ab.log
P="python -m pytest -q -p no:cacheprovider"
timeout 150 $P tests/test_rac.py -k "every_gpu_config" > $OUT/t_every.log 2>&1 &
timeout 150 $P -m cuda tests/test_rac.py -k "grouped or experts or gluon or pdl or qwen3" > $OUT/t_grouped.log 2>&1 &
wait
for f in $OUT/t_*.log; do echo "== $f"; tail -1 $f; done
grep -E "^FAILED|^E  " $OUT/t_*.log | head -10
