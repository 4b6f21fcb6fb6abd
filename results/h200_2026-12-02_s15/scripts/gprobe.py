"""Gluon probe: codes loaded straight into mma_v2's B-operand layout (kWidth 8), decoded in registers."""
import os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

KW = int(os.environ.get("KW", "8"))

@gluon.jit
def _pairs(packed):
    even, odd = gl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 lo, hi, t;
        .reg .b16 l0, l1, h0, h1;
        and.b32 t, $4, 0x08080808;
        shl.b32 t, t, 4;
        and.b32 lo, $4, 0x07070707;
        shl.b32 lo, lo, 2;
        or.b32 lo, lo, t;
        shr.b32 hi, $4, 2;
        and.b32 hi, hi, 0x1C1C1C1C;
        and.b32 t, $4, 0x80808080;
        or.b32 hi, hi, t;
        mov.b32 {l0, l1}, lo;
        mov.b32 {h0, h1}, hi;
        cvt.rn.f16x2.e4m3x2 $0, l0;
        cvt.rn.f16x2.e4m3x2 $1, l1;
        cvt.rn.f16x2.e4m3x2 $2, h0;
        cvt.rn.f16x2.e4m3x2 $3, h1;
        }
        """,
        constraints="=r,=r,=r,=r,r", args=[packed], dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
    return even, odd

@gluon.jit
def probe(x_ptr, w_ptr, ws_ptr, y_ptr, K, stride_x, x_plane, stride_w, stride_ws,
          BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, KW: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    KC: gl.constexpr = BK // 2
    kb = gl.arange(0, KC, layout=gl.SliceLayout(1, b_l))
    nb = gl.arange(0, BN, layout=gl.SliceLayout(0, b_l))
    ma = gl.arange(0, BM, layout=gl.SliceLayout(1, a_l))
    ka = gl.arange(0, KC, layout=gl.SliceLayout(0, a_l))
    acc = gl.zeros((BM, BN), gl.float32, layout=mma)
    for k0 in range(0, K, BK):
        codes = gl.load(w_ptr + nb[None, :] * stride_w + (k0 // 2 + kb)[:, None])
        sb = gl.load(ws_ptr + nb[None, :] * stride_ws + (k0 // 16 + kb // 8)[:, None])
        scale = sb.to(gl.float8e4nv, bitcast=True).to(gl.float16)
        even, odd = _pairs(codes)
        even = even * scale
        odd = odd * scale
        xe = gl.load(x_ptr + ma[:, None] * stride_x + (k0 // 2 + ka)[None, :])
        xo = gl.load(x_ptr + x_plane + ma[:, None] * stride_x + (k0 // 2 + ka)[None, :])
        acc = gl.nvidia.ampere.mma_v2(xe, even, acc)
        acc = gl.nvidia.ampere.mma_v2(xo, odd, acc)
    mo = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    no = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    gl.store(y_ptr + mo[:, None] * BN + no[None, :], acc)

def build(fn, sig, consts, warps=4, stages=1):
    attrs = {(k,): [["tt.divisibility", 16]] for k, n in enumerate(fn.arg_names) if n not in consts}
    return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))

if __name__ == "__main__":
    sig = dict(x_ptr="*fp16", w_ptr="*u8", ws_ptr="*u8", y_ptr="*fp32", K="i32", stride_x="i32", x_plane="i32",
               stride_w="i32", stride_ws="i32", BM="constexpr", BN="constexpr", BK="constexpr", KW="constexpr")
    c = build(probe, sig, dict(BM=16, BN=128, BK=128, KW=KW))
    d = tempfile.mkdtemp(); p = os.path.join(d, "k.cubin"); open(p, "wb").write(c.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    sass = subprocess.run([tool + "/cuobjdump", "-sass", p], capture_output=True, text=True).stdout
    res = subprocess.run([tool + "/cuobjdump", "-res-usage", p], capture_output=True, text=True).stdout
    print(re.findall(r"REG:\d+|SHARED:\d+", res))
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\d\s+)?([A-Z0-9_.]+)", sass, re.M)
    import collections
    cnt = collections.Counter(o for o in ops)
    print(len(ops), sorted(cnt.items(), key=lambda t: -t[1])[:40])
    open(os.path.join(os.path.dirname(__file__), f"gprobe_kw{KW}.sass"), "w").write(sass)
