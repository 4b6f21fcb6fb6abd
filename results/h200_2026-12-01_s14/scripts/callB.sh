export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 90 python bench.py decode > $OUT/decode_B.log 2>&1
timeout 130 python bench.py gemm > $OUT/gemm_B.log 2>&1
timeout 50 python -m pytest -q -p no:cacheprovider tests/test_rac.py -k "pdl_launches" > $OUT/tests_pdl_B.log 2>&1
tail -1 $OUT/tests_pdl_B.log
grep "| rac nvfp4\|rac bf16 |" $OUT/decode_B.log | head -8
grep "^| .*_proj\|^| q/k/v\|^| 64 \|^| 256 " $OUT/gemm_B.log | head -24 | cut -c1-120
