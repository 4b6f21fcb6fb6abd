import sys, os, subprocess, tempfile
sys.path.insert(0, "/work/main/results/h200_2026-12-01_x_first/scripts")
import triton, sass, rac
p8, pf, i = "*u8", "*fp32", "i32"
tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
def usage(c):
    d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(c.asm["cubin"])
    out = subprocess.run([tool, "--dump-resource-usage", p], capture_output=True, text=True).stdout
    return [w for l in out.splitlines() if "REG" in l for w in l.split() if w.startswith(("REG", "SHARED"))]
def build(bm, bn, bk, warps, stages, split, xf, maxnreg=None, fused=False, res=False):
    consts = dict(FUSED=fused, HAS_RESIDUAL=res, X_BF16=True, W_FP16=False, OUT_BF16=True, GPU=True,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, BUCKET=1 if bm == 1 else 64, EVEN_K=True, X_FIRST=xf)
    types = (["*bf16", "*i32", p8, pf] if fused else ["*fp16", "*fp16", p8, pf]) + [p8, p8, pf, "*i16", pf, "*i32"] + [i] * 11
    fn = sass.jitfn(rac._dense_kernel)
    from triton.compiler import ASTSource, compile
    from triton.backends.compiler import GPUTarget
    names = fn.arg_names; sig = {}; ti = iter(types)
    for n in names: sig[n] = "constexpr" if n in consts else next(ti)
    attrs = {(k,): [["tt.divisibility", 16]] for k, n in enumerate(names)
             if n not in consts and (sig[n].startswith("*") or n.startswith(("stride", "N", "K", "x_plane")))}
    opts = dict(num_warps=warps, num_stages=stages)
    if maxnreg: opts["maxnreg"] = maxnreg
    return compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
for args in [(32, 64, 256, 4, 3, 2, False), (32, 64, 256, 4, 3, 2, True), (64, 64, 128, 4, 3, 2, False), (128, 64, 128, 4, 3, 1, False)]:
    c = build(*args); ops = sass.count(sass.sass(c))
    print(args, usage(c), "instr", sum(ops.values()), {k: ops[k] for k in ("HGMMA", "HMMA", "LDS", "STS", "LDSM", "BAR", "F2FP", "HMUL2", "LOP3", "PRMT")})
for m in (None, 168, 128):
    c = build(1, 16, 2048, 4, 1, 1, False, maxnreg=m, fused=True, res=True); ops = sass.count(sass.sass(c))
    print("GEMV fused 16/2048 maxnreg", m, usage(c), "instr", sum(ops.values()), "STL", ops["STL"], "LDL", ops["LDL"])
