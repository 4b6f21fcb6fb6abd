export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
timeout 240 python bench.py decode > $OUT/decode_62da761.log 2>&1
grep "| rac\|moe.py" $OUT/decode_62da761.log | head -12
timeout 150 python .devnext/prof_decode_s13.py > $OUT/prof_62da761.log 2>&1
head -30 $OUT/prof_62da761.log
