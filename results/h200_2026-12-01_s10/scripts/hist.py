import os, sys, collections, re, subprocess, tempfile
sys.path.insert(0, "/tmp/exp")
os.environ.setdefault("WT", "*i16")
import importlib.util
spec = importlib.util.spec_from_file_location("ca", "/tmp/exp/count_all.py")
src = open("/tmp/exp/count_all.py").read().split('p8, pf, p16, i = "*u8"')[0]
ns = {}
exec(src, ns)
import rac
p8, pf, p16, i = "*u8", "*fp32", "*fp16", "i32"
WT = os.environ["WT"]
kind = sys.argv[1]
if kind == "dense":
    bm, bn, bk, w, s, sk, xf = [int(v) for v in sys.argv[2:9]]
    consts = dict(FUSED=False, HAS_RESIDUAL=False, X_BF16=False, W_FP16=False, OUT_BF16=True, GPU=True, BLOCK_M=bm,
                  BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, BUCKET=64, EVEN_K=True, X_FIRST=bool(xf))
    c = ns["build"](rac._dense_kernel, [p16, p16, p8, pf, WT, WT, pf, "*i16", pf, "*i32"] + [i] * 11, consts, w, s)
else:
    bm, bn, bk, w, s, xf = [int(v) for v in sys.argv[2:8]]
    if os.environ.get("QS"): WT2 = os.environ["QS"]
    consts = dict(GATHER=True, ROW_WEIGHTS=False, SWIGLU=True, OUT_BF16=True, GPU=True, E_POW2=128,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, BUCKET=16, EVEN_K=True, X_FIRST=bool(xf))
    c = ns["build"](rac._grouped_kernel, [p16, pf, "*i64", pf, WT, WT, pf, "*i64", "*i16"] + [i] * 11, consts, w, s)
d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(c.asm["cubin"])
import triton
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
text = subprocess.run([cuobjdump, "-sass", p], capture_output=True, text=True).stdout
open(f"/tmp/exp/{os.environ.get('TAG','x')}.sass", "w").write(text)
open(f"/tmp/exp/{os.environ.get('TAG','x')}.ttgir", "w").write(c.asm["ttgir"])
ins = []
for l in text.splitlines():
    m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)\s*([^;]*);", l)
    if m: ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
best = None
for addr, op, args in ins:
    if op == "BRA":
        t = re.search(r"0x([0-9a-f]+)", args)
        if t and int(t.group(1), 16) < addr:
            if best is None or addr - int(t.group(1), 16) > best[1] - best[0]: best = (int(t.group(1), 16), addr)
body = [op for a, op, _ in ins if best[0] <= a <= best[1]]
print(len(body), collections.Counter(body).most_common(22))
