"""The inline PTX of the ``mma`` decode kernel (:mod:`quantpack.kernels.mma_gemv`), built on the host as compile-time
strings: one 64-in-feature chunk's unpack + MMAs (:func:`chunk_asm`), the register hold that keeps a depth-0
program's loads in flight (:func:`hold_asm`), and the shared-memory sum of warps that split a program's K range
(:func:`ksum_asm`)."""
from __future__ import annotations

import functools

import torch


def hold_asm(outputs: int, inputs: int) -> tuple[str, str]:
    """PTX for :func:`_hold` (``pack=4``): output tensor i is input tensor i xor'ed with (all inputs xor'ed
    together) and the last input (zero): the result is the first inputs, after every input has arrived."""
    ins = [f"${4 * outputs + i}" for i in range(4 * inputs)]
    s = "{ .reg .b32 t; " + f"mov.b32 t, {ins[0]};"
    rest = ins[1:-4]
    for i in range(0, len(rest) - 1, 2):
        s += f" lop3.b32 t, t, {rest[i]}, {rest[i + 1]}, 0x96;"
    if len(rest) % 2:
        s += f" xor.b32 t, t, {rest[-1]};"
    s += f" and.b32 t, t, {ins[-4]};"
    s += "".join(f" xor.b32 ${i}, {ins[i]}, t;" for i in range(4 * outputs))
    return s + " }", ",".join(["=r"] * (4 * outputs) + ["r"] * (4 * inputs))


def ksum_asm(count: int, kwarps: int, rows: int) -> tuple[str, str]:
    """PTX for :func:`_ksum` (``pack=4``): each thread stores its row of ``count`` (32 x warps, 4) accumulators to shared
    memory, one barrier, then sums the rows of its tile slot over the ``kwarps`` K parts (``rows`` = 32 x warps along N
    apart), in the same order in every warp. Operands: outputs (4 f32 per accumulator), the accumulators, the row index."""
    outs = [f"${i}" for i in range(4 * count)]
    ins = [f"${4 * count + i}" for i in range(4 * count)]
    row = f"${8 * count}"
    pitch = 16 * count  # bytes of one row's accumulators
    s = ("{ .reg .b32 a, b, r; .reg .f32 t0, t1, t2, t3, u0, u1, u2, u3; "
         f".shared .align 16 .b8 ksum[{pitch * rows * kwarps}]; mov.u32 a, ksum; mad.lo.u32 b, {row}, {pitch}, a;")
    for i in range(count):
        s += f" st.shared.v4.f32 [b+{16 * i}], {{{', '.join(ins[4 * i:4 * i + 4])}}};"
    s += f" bar.sync 0; and.b32 r, {row}, {rows - 1}; mad.lo.u32 b, r, {pitch}, a;"
    for i in range(count):
        s += f" ld.shared.v4.f32 {{t0, t1, t2, t3}}, [b+{16 * i}];"
        for p in range(1, kwarps):
            s += f" ld.shared.v4.f32 {{u0, u1, u2, u3}}, [b+{p * rows * pitch + 16 * i}];"
            s += "".join(f" add.f32 t{e}, t{e}, u{e};" for e in range(4))
        s += "".join(f" mov.f32 {outs[4 * i + e]}, t{e};" for e in range(4))
    return s + " }", ",".join(["=f"] * (4 * count) + ["f"] * (4 * count) + ["r"] * 4)


MODES = ("zero", "raw_sum", "raw")


def _chunk_asm(fp16: bool, frags: int, mode: str) -> str:
    """PTX for one 64-in-feature chunk on each lane's fragments (one row of a (32*W, 4) tensor per
    lane, ``pack=4``): per k-step j, unpack word j of A (shift + LOP3 to ``q + offset``) and run
    ``d[f] += A . B[f]`` for each 8-row fragment f of x (one unpack serves them all). ``mode``:

    * ``zero``: A becomes ``q - z`` first (two adds: exact, then rounded to x's dtype, as
      dequantizing rounds): 15 integer/half2 instructions and one MMA per k-step and fragment;
    * ``raw_sum``: A stays ``q + offset`` (7 instructions) and a second MMA with an all-ones A gives
      ``sx[f] += sum(x)`` in the accumulator layout, for the per-group ``s (d - (z + offset) sx)``;
    * ``raw``: as ``raw_sum`` without the sums (a warp's second tile reuses its first tile's).

    Operands in order: outputs ``d[f]`` (4 f32 each), then ``sx[f]`` (raw_sum); inputs: A words (4),
    per fragment the first and second B registers (4 + 4), ``-z`` of rows g and g + 8 as 16-bit pairs
    (2, zero), ``d[f]`` in, ``sx[f]`` in (raw_sum). Inputs are copied to local registers first so
    no output can alias an input that is still to be read."""
    assert mode in MODES
    magic, offset, one, ty = (("0x64006400", "0xE400E400", "0x3C003C00", "f16") if fp16 else
                              ("0x43004300", "0xC300C300", "0x3F803F80", "bf16"))
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32"
    sums = mode == "raw_sum"
    regs = iter(range(1024))

    def take(count):
        return [f"${next(regs)}" for _ in range(count)]
    d_out = [take(4) for _ in range(frags)]
    sx_out = [take(4) for _ in range(frags)] if sums else []
    words = take(4)
    b = [(take(4), take(4)) for _ in range(frags)]
    nz = take(2) if mode == "zero" else []
    d_in = [take(4) for _ in range(frags)]
    sx_in = [take(4) for _ in range(frags)] if sums else []
    acc = [[f"d{f}_{i}" for i in range(4)] for f in range(frags)]
    acc_sx = [[f"e{f}_{i}" for i in range(4)] for f in range(frags)] if sums else []
    s = "{ .reg .b32 q0, q1, q2, q3, t, z0, z1, off, one; .reg .f32 " + ", ".join(sum(acc + acc_sx, [])) + ";"
    if mode == "zero":
        s += f" mov.b32 z0, {nz[0]}; mov.b32 z1, {nz[1]}; mov.b32 off, {offset};"
    if sums:
        s += f" mov.b32 one, {one};"
    s += "".join(f" mov.f32 {r}, {v};" for regs_, vals in zip(acc + acc_sx, d_in + sx_in)
                 for r, v in zip(regs_, vals))
    for j, w in enumerate(words):
        for r in range(4):  # register r = h + 2 kh: nibbles at bits 4r and 16 + 4r
            if r:
                s += f" shr.b32 t, {w}, {4 * r};"
            s += f" lop3.b32 q{r}, {w if r == 0 else 't'}, 0x000F000F, {magic}, 0xEA;"
            if mode == "zero":
                s += f" add.{ty}x2 q{r}, q{r}, off; add.{ty}x2 q{r}, q{r}, z{r % 2};"
        for f in range(frags):
            frag_b = f"{{{b[f][0][j]}, {b[f][1][j]}}}"
            d = ", ".join(acc[f])
            s += f" {mma} {{{d}}}, {{q0, q1, q2, q3}}, {frag_b}, {{{d}}};"
            if sums:
                e = ", ".join(acc_sx[f])
                s += f" {mma} {{{e}}}, {{one, one, one, one}}, {frag_b}, {{{e}}};"
    s += "".join(f" mov.f32 {v}, {r};" for regs_, vals in zip(acc + acc_sx, d_out + sx_out)
                 for r, v in zip(regs_, vals))
    return s + " }"


def _chunk_constraints(frags: int, mode: str) -> str:
    sums = 2 if mode == "raw_sum" else 1
    return ",".join(["=f"] * (4 * frags * sums) + ["r"] * (4 + 8 * frags + (2 if mode == "zero" else 0))
                    + ["f"] * (4 * frags * sums))


@functools.cache
def chunk_asm(dtype: torch.dtype, frags: int, mode: str) -> tuple[str, str]:
    """The chunk's PTX and its operand constraints for x's dtype, ``frags`` 8-row fragments of x and ``mode``."""
    return _chunk_asm(dtype == torch.float16, frags, mode), _chunk_constraints(frags, mode)
