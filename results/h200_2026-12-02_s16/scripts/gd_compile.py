import os, re, subprocess, sys, tempfile
sys.path.insert(0, os.path.dirname(__file__))
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import gd
fn = gd.dense_gluon_kernel
types = ["*bf16", "*i32", "*u8", "*fp32", "*u8", "*u8", "*fp32", "*bf16", "*fp32", "*i32"] + ["i32"] * 9
def build(consts, warps):
    ti = iter((["*bf16"] if consts["FUSED"] else ["*fp16"]) + types[1:])
    sig = {n: ("constexpr" if n in consts else next(ti)) for n in fn.arg_names}
    attrs = {(k,): [["tt.divisibility", 16]] for k, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n.startswith(("stride", "N", "K")))}
    return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps))
cases = [dict(FUSED=True, BLOCK_T=8, BLOCK_N=128, BLOCK_K=256, STEPS=1, NUM_WARPS=4, LOAD_FIRST=True, DROP=d) for d in range(5)]
cases += [dict(FUSED=False, BLOCK_T=t, BLOCK_N=n, BLOCK_K=k, STEPS=st, NUM_WARPS=4, LOAD_FIRST=False, DROP=0)
          for t, n, k, st in ((64, 64, 64, 32), (32, 64, 64, 32), (16, 64, 128, 16), (64, 128, 64, 32))]
for cs in cases:
    w = cs["NUM_WARPS"]; bn, bk, st, lf = cs["BLOCK_N"], cs["BLOCK_K"], cs["STEPS"], cs["DROP"]
    c = build(dict(HAS_RESIDUAL=True, X_BF16=True, PDL=True, **cs), w)
    d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(c.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    sass = subprocess.run([tool + "/cuobjdump", "-sass", p], capture_output=True, text=True).stdout
    res = subprocess.run([tool + "/cuobjdump", "-res-usage", p], capture_output=True, text=True).stdout
    open(os.path.join(os.path.dirname(__file__), f"gd_{int(cs['FUSED'])}_{cs['BLOCK_T']}_{bn}_{bk}_{st}_{w}_{lf}.sass"), "w").write(sass)
    ptx = c.asm["ptx"]
    print(cs, re.findall(r"REG:\d+|SHARED:\d+", res), "mma", ptx.count("mma.sync"),
          "ld.v2", len(re.findall(r"ld\.global(?:\.\w+)*\.v2\.b32", ptx)), "sass lines", sass.count("\n"), flush=True)
