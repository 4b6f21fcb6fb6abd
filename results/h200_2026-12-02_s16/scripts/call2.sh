export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 170 python .devnext/s16/gd_gpu2.py m1 > $OUT/gd_m1.log 2>&1; cat $OUT/gd_m1.log
timeout 380 python .devnext/s16/gd_gpu2.py big > $OUT/gd_big.log 2>&1; cat $OUT/gd_big.log
