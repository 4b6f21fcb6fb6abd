"""CPU, no GPU: compile the experts' Gluon kernel for sm_90 at 20 configurations and print a hash of each PTX without its
source-location lines. Run before and after a refactor (env -u TRITON_INTERPRET PYTHONPATH=$PWD python ...):
equal hashes mean the same machine code. Session 19 used it for 84d0a9f (Triton 3.6)."""
import sys, hashlib, re, triton, rac
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
out = {}
for swiglu in (True, False):
    for tile, n, k, w in ((8, 64, 128, 4), (16, 128, 64, 4), (32, 64, 64, 4), (64, 64, 64, 4), (64, 128, 64, 8)):
        for pdl in (False, True):
            c = dict(GATHER=swiglu, ROW_WEIGHTS=not swiglu, WEIGHT_IDS=not swiglu, SWIGLU=swiglu, E_POW2=128,
                     CHUNK=128, PDL=pdl, BUCKET=8, BLOCK_T=tile, BLOCK_N=n, BLOCK_K=k, NUM_WARPS=w)
            signature = dict(zip([a for a in kernel.arg_names if a not in c], types))
            signature.update({a: "constexpr" for a in c})
            aligned = [a for a in kernel.arg_names if a not in c
                       and (signature[a].startswith("*") or a.startswith(("stride", "N", "K", "x_plane")))]
            attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
            ptx = compile(GluonASTSource(kernel, signature, c, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=w)).asm["ptx"]
            body = ptx.split(".section")[0]  # the debug sections name source lines
            body = "\n".join(l for l in body.splitlines() if not l.strip().startswith((".loc", ".file", "//")))
            print(swiglu, tile, n, k, w, pdl, hashlib.sha1(body.encode()).hexdigest()[:12], len(body))
