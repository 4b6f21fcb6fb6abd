"""Write the stage-dropped copies of rac.py that experts_drop.py times (run from the repository root):
v1 no E2M1 bit arithmetic or conversion (the inline PTX only copies the packed word), v2 no block scales (their
loads, conversion and multiply), v3 neither, v4 the activation tile loaded once before the K loop, v5 = v3 + v4.
Timings are all the variants are good for: their outputs are wrong on purpose."""
import os

src = open("rac.py").read()
asm_first, asm_last = "                and.b32 t, $4, 0x08080808;", "                cvt.rn.f16x2.e4m3x2 $3, h1;"
a0, a1 = src.index(asm_first), src.index(asm_last) + len(asm_last)
copies = "\n".join(f"                mov.b32 ${i}, $4;" for i in range(4))
scales = ("            even = tl.reshape(tl.reshape(even, (ROWS, GB, 8)) * block_scale, (ROWS, BLOCK_K // 2))\n"
          "            odd = tl.reshape(tl.reshape(odd, (ROWS, GB, 8)) * block_scale, (ROWS, BLOCK_K // 2))")
loop = "        for k0 in range(k_begin, k_end, BLOCK_K):\n            if W_FP16:"
x_load = ("            else:\n                x_even, x_odd = _operand_tile(x_ptr, x_rows, row_mask, k0, K, stride_x, "
          "x_plane, BLOCK_K,\n                                              EVEN_K, GEMV)")
for needle in (scales, loop, x_load):
    assert src.count(needle) == 1, needle


def no_decode(s):
    return s[:s.index(asm_first)] + copies + s[s.index(asm_last) + len(asm_last):]


def no_scales(s):
    return s.replace(scales, "            pass")


def x_once(s):
    s = s.replace(loop, "        if not GEMV and not FUSED:\n            x_even_h, x_odd_h = _operand_tile(x_ptr, x_rows, "
                  "row_mask, k_begin, K, stride_x, x_plane, BLOCK_K,\n                                              "
                  "EVEN_K, GEMV)\n" + loop)
    return s.replace(x_load, "            else:\n                x_even, x_odd = x_even_h, x_odd_h")


variants = {"v1": no_decode(src), "v2": no_scales(src), "v3": no_scales(no_decode(src)), "v4": x_once(src),
            "v5": x_once(no_scales(no_decode(src)))}
for name, text in variants.items():
    os.makedirs(f".devnext/{name}", exist_ok=True)
    open(f".devnext/{name}/rac.py", "w").write(text)
    print(name, "written")
