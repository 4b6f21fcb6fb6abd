"""Compile the experts' Gluon kernel for sm_90 (Triton 3.6, CPU) and count the SASS instructions of its K loop."""
import re, subprocess, sys, os, collections, triton, rac
from triton.backends.compiler import GPUTarget
from triton.compiler import compile
from triton.experimental.gluon._runtime import GluonASTSource
def jit(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel
kernel = jit(rac._grouped_gluon_kernel)
i = "i32"
types = ["*fp16", "*fp32", "*i64", "*fp32", "*i64", "*u8", "*u8", "*fp32", "*i64", "*bf16"] + [i] * 13
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
for swiglu, tile, n, k, w in ((True, 32, 64, 64, 4), (True, 8, 64, 128, 4), (False, 32, 128, 64, 4), (False, 8, 128, 128, 4)):
    c = dict(GATHER=swiglu, ROW_WEIGHTS=not swiglu, WEIGHT_IDS=not swiglu, SWIGLU=swiglu, E_POW2=128,
             CHUNK=128, PDL=True, BUCKET=16, BLOCK_T=tile, BLOCK_N=n, BLOCK_K=k, NUM_WARPS=w)
    signature = dict(zip([a for a in kernel.arg_names if a not in c], types))
    signature.update({a: "constexpr" for a in c})
    aligned = [a for a in kernel.arg_names if a not in c
               and (signature[a].startswith("*") or a.startswith(("stride", "N", "K", "x_plane")))]
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    out = compile(GluonASTSource(kernel, signature, c, attrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=w))
    path = f"/tmp/sass/k_{int(swiglu)}_{tile}_{n}_{k}.cubin"
    open(path, "wb").write(out.asm["cubin"])
    sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", path], capture_output=True, text=True).stdout
    open(path + ".sass", "w").write(sass)
    print(swiglu, tile, n, k, w, "sass lines", len(sass.splitlines()))
