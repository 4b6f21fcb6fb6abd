export PYTHONPATH=$PWD
timeout 100 python -m pytest -q tests/test_rac.py -k "short_tiles" -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/tests_short_tiles_main.log
cp rac.py /tmp/rac.bak
sed -i 's/y_mask = (t_y < end_row)\[None, :\] & (col_y < n_out)\[:, None\]/y_mask = (t_y < end_row)[None, :] \& (col_y < n_out + 16)[:, None]/' rac.py
grep -c "col_y < n_out + 16" rac.py
timeout 100 python -m pytest -q tests/test_rac.py -k "short_tiles" -p no:cacheprovider 2>&1 | grep -E "passed|failed|relative error" | head -4 | tee $OUT/tests_short_tiles_broken.log
cp /tmp/rac.bak rac.py
timeout 150 python .devnext/s20/caps.py 2>&1 | tee $OUT/caps.log
timeout 420 python bench.py gemm > $OUT/gemm.log 2>&1; echo gemm rc $?
grep -A12 "Expert layer" $OUT/gemm.log; grep "dense gate/up\|dense down" $OUT/gemm.log | head -12
