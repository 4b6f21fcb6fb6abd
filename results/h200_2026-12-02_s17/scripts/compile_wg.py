import re, sys, time
sys.path.insert(0, ".devnext/s17")
import wg
from triton.experimental.gluon._runtime import GluonASTSource
from triton.backends.compiler import GPUTarget
from triton.compiler import compile
kernel = wg.wg_kernel
import subprocess, tempfile, os, triton
def regs(k):
    d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    res = subprocess.run([tool, "-res-usage", p], capture_output=True, text=True).stdout
    return "regs " + ",".join(re.findall(r"REG:(\d+)", res)) + " stack " + ",".join(re.findall(r"STACK:(\d+)", res))
i = "i32"
types = ["*fp16", "*fp32", "*i64", "*fp32", "*i64", "*u8", "*u8", "*fp32", "*i64", "*bf16"] + [i] * 12
cfgs = [tuple(map(int, a.split(","))) for a in sys.argv[1:]] or [(1, 32, 64, 64), (0, 32, 64, 64)]
for swiglu, T, BN, BK, *pf in cfgs:
    t0 = time.time()
    c = wg.constants(bool(swiglu), T, BN, BK, prefetch=bool(pf and pf[0]))
    signature = dict(zip([a for a in kernel.arg_names if a not in c], types))
    signature.update({a: "constexpr" for a in c})
    aligned = [a for a in kernel.arg_names if a not in c and (signature[a].startswith("*") or a.startswith(("stride", "N", "K", "x_plane")))]
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    k = compile(GluonASTSource(kernel, signature, c, attrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = k.asm["ptx"]
    name = f".devnext/s17/wg_{swiglu}_{T}_{BN}_{BK}_{int(bool(pf and pf[0]))}"
    open(name + ".ptx", "w").write(ptx)
    open(name + ".ttgir", "w").write(k.asm["ttgir"])
    cnt = lambda p: len(re.findall(p, ptx))
    print(swiglu, T, BN, BK, "wgmma", cnt(r"wgmma\.mma_async"), "ld.global.v2", cnt(r"ld\.global(?:\.\w+)*\.v2\.b32"),
          "ld.global.v4", cnt(r"ld\.global(?:\.\w+)*\.v4\.b32"), "u8", cnt(r"ld\.global(?:\.\w+)*\.[us]8"),
          "st.shared", cnt(r"st\.shared"), "ld.shared", cnt(r"ld\.shared"), "bar", cnt(r"bar\.sync"),
          "shared", k.metadata.shared, f"{time.time()-t0:.1f}s", regs(k), flush=True)
