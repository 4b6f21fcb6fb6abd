"""sm_90 PTX hashes (debug sections and .loc lines stripped) of the Triton dense, grouped, GEMV and weight-operand
kernels at 12 configurations, compiled on the CPU with Triton 3.6; TAG names the run."""
import hashlib, re, sys, triton, rac
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
def jit(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel
i = "i32"
dense_types = ["*fp16", "*fp32", "*u8", "*u8", "*fp32", "*i16", "*fp32", "*i32"] + [i] * 11
grouped_types = ["*fp16", "*fp32", "*i64", "*fp32", "*i64", "*u8", "*u8", "*fp32", "*i64", "*i16"] + [i] * 13
cases = []
import os
for xf, (m, n, k, s) in [(xf, c) for xf in (True, False) for c in ((16, 64, 256, 4), (64, 64, 128, 2), (128, 64, 128, 1))]:
    for wf in (False,):
        cases.append(("dense", rac._dense_kernel, dense_types, dict(W_FP16=wf, OUT_BF16=True, BUCKET=16, EVEN_K=True,
                      BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, SPLIT_K=s, X_FIRST=xf, GPU=True, PDL=True)))
for sw in (True, False):
    for m, n, k in ((16, 64, 128), (64, 128, 64)):
        cases.append(("grouped", rac._grouped_kernel, grouped_types, dict(GATHER=sw, ROW_WEIGHTS=not sw, WEIGHT_IDS=not sw,
                      SWIGLU=sw, OUT_BF16=True, GPU=True, E_POW2=128, CHUNK=128, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k,
                      SPLIT_K=1, BUCKET=16, EVEN_K=True, X_FIRST=True, PDL=True)))
cases.append(("gemv", rac._gemv_kernel, ["*fp16", "*fp32", "*u8", "*u8", "*fp32", "*i16"] + [i] * 7,
              dict(OUT_BF16=True, GPU=True, BLOCK_N=4, BLOCK_K=2048, STEPS=2, EVEN_K=True, PDL=True)))
cases.append(("weight_operand", rac._weight_operand_kernel, ["*u8", "*u8", "*fp16"] + [i] * 5,
              dict(GPU=True, ROWS=64, BLOCK_K=256)))
for name, kernel, types, c in cases:
    kernel = jit(kernel)
    names = [a for a in kernel.arg_names if a not in c]
    signature = dict(zip(names, types)); signature.update({a: "constexpr" for a in c})
    try:
        ptx = compile(ASTSource(kernel, signature, c), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:200]); continue
    ptx = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    body = "\n".join(l for l in ptx.splitlines() if not l.strip().startswith((".loc", ".file", "//")) and "debug" not in l)
    body = re.sub(r"\.section\s+\.debug.*", "", body, flags=re.S)
    import os
    tag = os.environ.get("TAG", "x"); idx = globals().setdefault("_n", [0]); idx[0] += 1
    open(f"/tmp/ptx_{tag}_{idx[0]}_{name}.ptx", "w").write(body)
    print(name, hashlib.sha1(body.encode()).hexdigest()[:12], flush=True)
