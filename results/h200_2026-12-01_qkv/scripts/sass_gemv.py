import sys, os, subprocess, tempfile
sys.path.insert(0, "/work/main/results/h200_2026-12-01_x_first/scripts")
import triton, sass, rac
p8, pf, i = "*u8", "*fp32", "i32"
tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
def usage(c):
    d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(c.asm["cubin"])
    out = subprocess.run([tool, "--dump-resource-usage", p], capture_output=True, text=True).stdout
    return " ".join(l.strip() for l in out.splitlines() if "REG" in l)
for bn, bk, split, warps in [(16, 2048, 1, 4), (8, 1024, 2, 4), (16, 512, 4, 4), (16, 4096, 1, 8)]:
    for fused in (True, False):
        consts = dict(FUSED=fused, HAS_RESIDUAL=fused, X_BF16=True, W_FP16=False, OUT_BF16=True, GPU=True,
                      BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, BUCKET=1, EVEN_K=True, X_FIRST=False)
        types = (["*bf16", "*i32", p8, pf] if fused else ["*fp16", "*fp16", p8, pf]) + [p8, p8, pf, "*i16", pf, "*i32"] + [i] * 11
        c = sass.build(rac._dense_kernel, types, consts, warps, 1)
        ops = sass.count(sass.sass(c))
        print((bn, bk, split, warps), "fused" if fused else "operand", usage(c), "| instr", sum(ops.values()),
              {k: ops[k] for k in ("LDG", "LDS", "STS", "BAR", "SHFL", "FFMA", "FMUL", "F2FP", "HMUL2", "F2F", "LOP3", "PRMT")})
