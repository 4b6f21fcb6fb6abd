"""Compile rac's grouped kernel for sm_90 (Triton on PYTHONPATH) per config: registers, shared memory, loops."""
import os, re, subprocess, sys, tempfile, time
import triton, rac
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

def jitfn(k):
    while not isinstance(k, triton.runtime.jit.JITFunction):
        k = k.fn
    return k

def build(kernel, types, constants, warps, stages, maxnreg=None):
    fn = jitfn(kernel)
    names = fn.arg_names
    ti = iter(types)
    sig = {n: ("constexpr" if n in constants else next(ti)) for n in names}
    attrs = {(k,): [["tt.divisibility", 16]] for k, n in enumerate(names)
             if n not in constants and (sig[n].startswith("*") or n.startswith(("stride", "N", "K", "x_plane")))}
    return compile(ASTSource(fn, sig, constants, attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {})))

pf, p16, i = "*fp32", "*fp16", "i32"
if __name__ == "__main__":
  for swiglu in (True, False):
    for bm, bn, bk, w, s, xf, mr, sm in [(16, 64, 256, 4, 3, 1, None, 0), (16, 64, 256, 4, 2, 1, 128, 0),
                                         (32, 64, 256, 4, 3, 1, None, 16), (32, 64, 256, 4, 2, 1, 128, 16),
                                         (32, 64, 128, 4, 3, 1, None, 16), (32, 128, 128, 4, 3, 1, None, 16)]:
        consts = dict(GATHER=swiglu, ROW_WEIGHTS=not swiglu, SWIGLU=swiglu, OUT_BF16=True, GPU=True, E_POW2=128,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, BUCKET=16, EVEN_K=True, X_FIRST=bool(xf),
                      SMALL_M=sm)
        types = [p16, pf, "*i64", pf, "*u8", "*u8", pf, "*i64", "*i16"] + [i] * 11
        t = time.time()
        c = build(rac._grouped_kernel, types, consts, w, s, mr)
        cub = c.asm["cubin"]
        d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(cub)
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        res = subprocess.run([tool, "-res-usage", p], capture_output=True, text=True).stdout
        regs = re.findall(r"REG:(\d+)", res)
        print(f"swiglu={swiglu} {bm}/{bn}/{bk} w{w} s{s} mr{mr} small{sm}: "
              f"shared {c.metadata.shared} regs {regs} ({time.time() - t:.1f} s)", flush=True)
