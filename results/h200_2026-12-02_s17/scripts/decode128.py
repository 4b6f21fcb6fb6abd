"""Decode step at batch 128: rac bf16 and nvfp4 + RAC 0.5 on this tree, then nvfp4 + RAC 0.5 on the rac.py before
9a800a2 (same process; bench.py's method)."""
import importlib.util, sys
import bench, rac
print(bench.gpu_header(), flush=True)
bench._bench_decode_per_precision(rac, batches=(128,), variants=[("rac bf16", "bf16", 0.0),
                                  ("rac nvfp4 + RAC 0.5", "nvfp4", 0.5)], checks=[])
spec = importlib.util.spec_from_file_location("rac_before", ".devnext/s17/rac_before_b8.py")
before = importlib.util.module_from_spec(spec); sys.modules["rac_before"] = before; spec.loader.exec_module(before)
bench._bench_decode_per_precision(before, batches=(128,), variants=[("rac nvfp4 + RAC 0.5, before 9a800a2", "nvfp4", 0.5)],
                                  checks=[])
