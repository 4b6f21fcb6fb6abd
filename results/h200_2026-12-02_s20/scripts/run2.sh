export PYTHONPATH=$PWD
timeout 100 python -m pytest -q tests/test_rac.py -k "short_tiles" -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/tests_short_tiles.log
for mod in rac rac_noclamp; do
  RAC=$mod PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --print-limit 5 python .devnext/s20/sanitize.py 2>&1 | tail -25 > $OUT/memcheck_$mod.log
  tail -8 $OUT/memcheck_$mod.log
done
timeout 150 ncu --clock-control none --profile-from-start off -k regex:_grouped_gluon_kernel --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats python .devnext/s20/ncu_target.py > $OUT/ncu_experts_256.txt 2>&1
grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall Long|Issued Warp|No Eligible|Block Limit Reg|Warp Cycles Per Issued|Eligible Warps" $OUT/ncu_experts_256.txt | head -60
timeout 150 python .devnext/s20/ab.py 2>&1 | tee $OUT/ab.log
