"""SASS of rac's grouped kernel (sm_90, Triton 3.6 on PYTHONPATH) for several configs -> hash per config."""
import hashlib, os, re, subprocess, sys, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import triton, rac
from compile_grouped import build
pf, p16, i = "*fp32", "*fp16", "i32"
tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
for swiglu in (True, False):
    for bm, bn, bk, w, s, xf, mr, nt in [(16, 64, 256, 4, 3, 1, None, 1), (16, 64, 256, 4, 2, 1, 128, 1),
                                         (16, 128, 256, 4, 2, 1, 128, 4), (64, 128, 64, 4, 3, 0, None, 1)]:
        for pdl in (False, True):
            consts = dict(GATHER=swiglu, ROW_WEIGHTS=not swiglu, WEIGHT_IDS=not swiglu, SWIGLU=swiglu, OUT_BF16=True,
                          GPU=True, E_POW2=128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, BUCKET=16,
                          EVEN_K=True, X_FIRST=bool(xf), N_TILES=nt, PDL=pdl)
            types = [p16, pf, "*i64", pf, "*i64", "*u8", "*u8", pf, "*i64", "*i16"] + [i] * 11
            c = build(rac._grouped_kernel, types, consts, w, s, mr)
            d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(c.asm["cubin"])
            sass = subprocess.run([tool, "-sass", p], capture_output=True, text=True).stdout
            body = "\n".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", l) for l in sass.splitlines()
                             if re.search(r"^\s+/\*[0-9a-f]+\*/", l))
            print(swiglu, bm, bn, bk, w, s, xf, mr, nt, pdl, len(body.splitlines()),
                  hashlib.md5(body.encode()).hexdigest()[:12], flush=True)
