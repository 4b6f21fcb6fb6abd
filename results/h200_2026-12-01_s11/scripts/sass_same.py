"""SASS of rac's grouped kernel (sm_90, Triton on PYTHONPATH) for a few configs -> hash per config."""
import hashlib, os, re, subprocess, sys, tempfile
import triton, rac
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
sys.path.insert(0, os.path.dirname(__file__))
from compile_grouped import jitfn
pf, p16, i = "*fp32", "*fp16", "i32"
for swiglu in (True, False):
    for bm, bn, bk, w, s, xf, mr in [(16, 64, 256, 4, 3, 1, None), (16, 64, 256, 4, 2, 1, 128), (16, 128, 128, 4, 3, 1, None),
                                     (64, 128, 64, 4, 3, 0, None)]:
        consts = dict(GATHER=swiglu, ROW_WEIGHTS=not swiglu, SWIGLU=swiglu, OUT_BF16=True, GPU=True, E_POW2=128,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, BUCKET=16, EVEN_K=True, X_FIRST=bool(xf))
        fn = jitfn(rac._grouped_kernel)
        types = iter([p16, pf, "*i64", pf, "*u8", "*u8", pf, "*i64", "*i16"] + [i] * 11)
        sig = {n: ("constexpr" if n in consts else next(types)) for n in fn.arg_names}
        attrs = {(k,): [["tt.divisibility", 16]] for k, n in enumerate(fn.arg_names)
                 if n not in consts and (sig[n].startswith("*") or n.startswith(("stride", "N", "K", "x_plane")))}
        c = compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                    options=dict(num_warps=w, num_stages=s, **({"maxnreg": mr} if mr else {})))
        d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(c.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        sass = subprocess.run([tool, "-sass", p], capture_output=True, text=True).stdout
        body = "\n".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", l) for l in sass.splitlines() if re.search(r"^\s+/\*[0-9a-f]+\*/", l))
        print(swiglu, bm, bn, bk, w, s, xf, mr, len(body.splitlines()), hashlib.md5(body.encode()).hexdigest()[:12])
