import re, sys
sys.path.insert(0, "results/h200_2026-12-02_s19/scripts")
import triton, gdense
from triton.backends.compiler import GPUTarget
from triton.compiler import compile
from triton.experimental.gluon._runtime import GluonASTSource
kernel = gdense.dense_gluon_kernel
i = "i32"
types = ["*fp16", "*fp32", "*u8", "*u8", "*fp32", "*bf16", "*fp32", "*i32"] + [i] * 11
for T, BN, BK, S, W, early in ((16, 64, 128, 16, 4, 1), (8, 32, 128, 8, 2, 0), (16, 64, 64, 1, 4, 1)):
    c = dict(BLOCKED=bool(early), CHUNK=128, REDUCE=1, K_FAST=bool(early), PDL=True, EARLY_W=bool(early), BLOCK_T=T, BLOCK_N=BN, BLOCK_K=BK, SPLIT_K=S, NUM_WARPS=W)
    signature = dict(zip([a for a in kernel.arg_names if a not in c], types))
    signature.update({a: "constexpr" for a in c})
    aligned = [a for a in kernel.arg_names if a not in c and (signature[a].startswith("*") or a.startswith(("stride", "K", "x_plane")))]
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    ptx = compile(GluonASTSource(kernel, signature, c, attrs), target=GPUTarget("cuda", 90, 32),
                  options=dict(num_warps=W)).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    before = ptx[:wait]
    print(T, BN, BK, S, W, early, "mma", len(re.findall(r"mma\.sync", ptx)), "loads before wait",
          len(re.findall(r"ld\.global", before)), "v2 loads", len(re.findall(r"ld\.global(?:\.\w+)*\.v2\.b32", ptx)),
          "atom", len(re.findall(r"atom\.", ptx)))
