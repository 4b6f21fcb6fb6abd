#!/bin/bash
# ncu probe (hardware counters, if this runtime allows) + the verification of next.sh.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p $OUT/ncu
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
for t in grouped_gu grouped_dn dense_q64; do
  k=_grouped_kernel; [ $t = dense_q64 ] && k=_dense_kernel
  timeout 90 $NCU --clock-control none --launch-skip 3 --launch-count 1 -k regex:$k \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    python .devnext/ncu_target.py $t > $OUT/ncu/$t.txt 2>&1
  echo "$t rc=$?"; grep -E "Duration|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued|Registers Per|No Eligible|Stall|L1/TEX Cache Throughput|Compute \(SM\)" $OUT/ncu/$t.txt | head -20
done
bash .devnext/next.sh
