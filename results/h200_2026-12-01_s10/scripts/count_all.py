"""Loop SASS counts for rac's grouped and dense kernels (sm_90, Triton 3.6), for the rac.py on PYTHONPATH."""
import collections, os, re, subprocess, sys, tempfile
import triton, rac
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
WT = os.environ.get("WT", "*i16")

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
             if n not in constants and (sig[n].startswith("*") or n.startswith(("stride", "N", "K", "x_plane", "w_plane")))}
    return compile(ASTSource(fn, sig, constants, attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {})))

def loop(c):
    d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(c.asm["cubin"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    text = subprocess.run([cuobjdump, "-sass", p], capture_output=True, text=True).stdout
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
    body = [op for a, op, _ in ins if best[0] <= a <= best[1]] if best else []
    movs = sum(1 for o in body if o == "IMAD.MOV.U32" or o.startswith("MOV"))
    return len(body), movs, len(ins)

p8, pf, p16, i = "*u8", "*fp32", "*fp16", "i32"
print("grouped (SwiGLU gate/up): config -> loop instr, per weight element, moves")
for bm, bn, bk, w, s, xf, mr in [(16, 64, 256, 4, 3, 1, None), (16, 64, 256, 4, 2, 1, 128), (16, 128, 128, 4, 3, 1, None),
                                 (16, 32, 256, 4, 3, 0, None), (32, 64, 128, 4, 3, 0, None), (64, 128, 64, 4, 3, 0, None)]:
    consts = dict(GATHER=True, ROW_WEIGHTS=False, SWIGLU=True, OUT_BF16=True, GPU=True, E_POW2=128,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, BUCKET=16, EVEN_K=True, X_FIRST=bool(xf))
    types = [p16, pf, "*i64", pf, WT, WT, pf, "*i64", "*i16"] + [i] * 11
    n, m, tot = loop(build(rac._grouped_kernel, types, consts, w, s, mr))
    el = 2 * bn * bk / (w * 32)
    print(f"  {bm}/{bn}/{bk} w{w} s{s} xf{xf} mr{mr}: {n} ({n/el:.2f}/elem) moves {m}  [kernel {tot}]")
print("dense (operand from the quantizer): config -> loop")
for bm, bn, bk, w, s, sk, xf in [(32, 64, 256, 4, 3, 2, 0), (64, 64, 256, 8, 3, 4, 0), (32, 32, 256, 4, 3, 4, 0),
                                  (64, 128, 128, 4, 3, 2, 1), (64, 64, 256, 4, 3, 1, 1), (128, 64, 128, 4, 3, 1, 1),
                                  (64, 64, 128, 4, 3, 1, 0), (16, 64, 256, 4, 3, 4, 0)]:
    consts = dict(FUSED=False, HAS_RESIDUAL=False, X_BF16=False, W_FP16=False, OUT_BF16=True, GPU=True, BLOCK_M=bm,
                  BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, BUCKET=64, EVEN_K=True, X_FIRST=bool(xf))
    types = [p16, p16, p8, pf, WT, WT, pf, "*i16", pf, "*i32"] + [i] * 11
    n, m, tot = loop(build(rac._dense_kernel, types, consts, w, s))
    el = bn * bk / (w * 32)
    print(f"  {bm}/{bn}/{bk} w{w} s{s} split{sk} xf{xf}: {n} ({n/el:.2f}/elem) moves {m}  [kernel {tot}]")
print("fused GEMV M=1: config -> whole kernel instructions (no loop at BLOCK_K = K)")
for bn, bk, w, sk in [(16, 2048, 4, 1), (16, 1024, 4, 2), (16, 512, 4, 4), (8, 1024, 4, 2)]:
    for res in (False, True):
        consts = dict(FUSED=True, HAS_RESIDUAL=res, X_BF16=True, W_FP16=False, OUT_BF16=True, GPU=True, BLOCK_M=1,
                      BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, BUCKET=1, EVEN_K=True, X_FIRST=False)
        types = ["*bf16", "*i32", p8, pf, WT, WT, pf, "*i16", pf, "*i32"] + [i] * 11
        n, m, tot = loop(build(rac._dense_kernel, types, consts, w, 1))
        print(f"  1/{bn}/{bk} w{w} split{sk} rac{int(res)}: kernel {tot} instr, loop {n}")
