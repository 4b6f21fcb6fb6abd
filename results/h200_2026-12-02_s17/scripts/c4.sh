# Session 17 call 4, tree of main 29e8a9f: the NVFP4Experts fast-path test, then bench.py gemm and decode (twice)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_rac.py -k "fast_path or experts" > $OUT/t_experts.log 2>&1; tail -1 $OUT/t_experts.log
timeout 200 python bench.py gemm > $OUT/gemm.log 2>&1
grep "^| 64 \|^| 256 " $OUT/gemm.log | cut -c1-200
timeout 140 python bench.py decode > $OUT/decode_run1.log 2>&1
grep "rac\|ratio\|x |" $OUT/decode_run1.log | head -12
timeout 140 python bench.py decode > $OUT/decode_run2.log 2>&1
grep "rac\|ratio\|x |" $OUT/decode_run2.log | head -12
