"""Compile rac.py's Hopper kernels for sm_90 on the CPU and count SASS instructions (whole kernel and loop)."""
import collections, os, re, subprocess, sys, tempfile
import triton, rac
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

def jitfn(k):
    while not hasattr(k, "arg_names") or hasattr(k, "fn") and not isinstance(k, triton.runtime.jit.JITFunction):
        k = k.fn
    return k

def build(kernel, types, constants, warps, stages):
    fn = jitfn(kernel)
    names = fn.arg_names
    sig = {}
    ti = iter(types)
    for n in names:
        sig[n] = "constexpr" if n in constants else next(ti)
    # what the JIT does at launch: pointers 16-byte aligned, sizes/strides divisible by 16 (true here)
    attrs = {(k,): [["tt.divisibility", 16]] for k, n in enumerate(names)
             if n not in constants and (sig[n].startswith("*") or n.startswith(("stride", "N", "K", "x_plane")))}
    c = compile(ASTSource(fn, sig, constants, attrs), target=GPUTarget("cuda", 90, 32),
                options=dict(num_warps=warps, num_stages=stages))
    return c

def sass(c):
    d = tempfile.mkdtemp()
    p = os.path.join(d, "k.cubin")
    open(p, "wb").write(c.asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    out = subprocess.run([cuobjdump, "-sass", p], capture_output=True, text=True).stdout
    return out

def count(text):
    ops = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(2).split(".")[0]] += 1
    return ops

if __name__ == "__main__":
    p8, pf, p16, i = "*u8", "*fp32", "*fp16", "i32"
    bm, bn, bk, w, s, xf = [int(v) for v in sys.argv[1:7]] if len(sys.argv) > 6 else (16, 32, 256, 4, 3, 0)
    consts = dict(GATHER=True, ROW_WEIGHTS=False, SWIGLU=True, OUT_BF16=True, GPU=True, E_POW2=128,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, BUCKET=16, EVEN_K=True, X_FIRST=bool(xf))
    types = [p16, pf, "*i64", pf, p8, p8, pf, "*i64", "*i16"] + [i] * 6 + [i] * 6
    c = build(rac._grouped_kernel, types, consts, w, s)
    text = sass(c)
    open("/tmp/grouped.sass", "w").write(text)
    print("shared", c.metadata.shared)
    ops = count(text)
    print(sum(ops.values()), "instructions;", ops.most_common(30))
