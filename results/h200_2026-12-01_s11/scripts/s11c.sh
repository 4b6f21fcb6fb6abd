#!/bin/bash
# Session 11, call C: grouped configurations with register caps (experts_regs.py); bench decode (decode-min)
# with Python's garbage collector off while timing (is the bimodal short call a GC pause?).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=$OUT; START=$(date +%s)
t() { echo "$1 $(( $(date +%s) - START ))s" | tee -a $L/times.log; }
timeout 200 python .devnext/experts_regs.py 64 256 > $L/experts_regs.log 2>&1; t "experts rc=$?"
cat $L/experts_regs.log | cut -c1-120
git apply .devnext/decode_min_bench.patch && t "decode-min applied"
timeout 130 python - > $L/decode_run3_nogc.log 2>&1 <<'PY'
import gc, time, torch, bench, rac, rollout
orig = rollout.generate
def timed(model, prompts, *a, **k):
    gc.collect(); gc.disable()
    torch.cuda.synchronize(); t0 = time.perf_counter(); out = orig(model, prompts, *a, **k); torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    gc.enable()
    print(f"@@ batch {len(prompts)} new {a[1] if len(a) > 1 else k.get('max_new_tokens')} {dt:.4f}", flush=True)
    return out
rollout.generate = timed
print(bench.gpu_header())
bench._bench_decode_per_precision(rac)
PY
t "decode rc=$?"; grep "| rac \|moe.py" $L/decode_run3_nogc.log | cut -c1-120
grep "@@" $L/decode_run3_nogc.log | awk '{print $3, $5, $6}' | paste - - - - - - 
git checkout bench.py
