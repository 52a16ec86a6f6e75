"""Bit-level float casts for Triton kernels: fp32 -> e4m3fn / e5m2 / e2m1 codes.

Why not ``x.to(tl.float8e4nv)``: the Triton interpreter (TRITON_INTERPRET=1, how the kernels are tested on
CPU) neither saturates nor rounds correctly in its fp32 -> fp8 conversion (DESIGN.md §6), and E2M1 has no
Triton dtype at all. These functions round with plain fp32 arithmetic and integer bit operations, which
the interpreter and the GPU compile the same way, so kernel and reference agree bit for bit on both.

Rounding scheme (any minifloat with M mantissa bits and smallest normal exponent EMIN): scale |v| by the
power of two that puts its last kept mantissa bit at 2^0, round to an integer with the classic
``(y + 2^23) - 2^23`` (round-to-nearest-even in fp32 for 0 <= y < 2^23), scale back. Target subnormals
share the quantum of the smallest normal binade, which the clamp of the exponent gives for free.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # triton ships for linux x86_64 only; everything has a plain-torch fallback
    HAS_TRITON = False

import torch

__all__ = ["HAS_TRITON", "use_triton"]


def use_triton(x: torch.Tensor) -> bool:
    """Whether a public quantize function should launch its Triton kernel for ``x``: a real CUDA
    tensor with triton installed. While torch.compile traces (fake tensors) the plain-torch
    reference is traced instead and inductor generates the kernel from it; CPU tensors always take
    the reference (tests call the launchers directly to run them in Triton's interpreter)."""
    from torch._subclasses.fake_tensor import is_fake

    return HAS_TRITON and isinstance(x, torch.Tensor) and x.is_cuda and not is_fake(x)

if HAS_TRITON:
    __all__ += ["fp32_to_fp8_bits", "fp8_bits_no_nan", "fp8_nan_bits", "nan_max", "mul_rn", "nan_abs_max",
                "round_fp32_to", "round_to_e4m3", "round_to_e5m2", "to_e4m3", "to_e5m2", "fp32_to_e2m1_bits",
                "e2m1_magnitude_code", "e2m1_bits_to_fp32", "max_drop_nan", "min_drop_nan"]

    @triton.jit
    def _round_magnitude(a, M_BITS: tl.constexpr, EMIN: tl.constexpr, MAX: tl.constexpr):
        """|v| (fp32, not NaN) rounded to the nearest-even value with M_BITS mantissa bits, saturating."""
        a = tl.minimum(a, MAX)
        e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF       # biased fp32 exponent of a
        e = tl.maximum(e, EMIN + 127)                          # subnormals: quantum of the lowest binade
        # y = a * 2^(M - (e - 127)) has its last kept bit at 2^0; both factors are exact powers of two.
        up = ((254 + M_BITS - e) << 23).to(tl.float32, bitcast=True)
        down = ((e - M_BITS) << 23).to(tl.float32, bitcast=True)
        y = a * up
        y = (y + 8388608.0) - 8388608.0                        # round half to even at integer precision
        return y * down

    @triton.jit
    def _minifloat_bits(v, M_BITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr,
                        MAX: tl.constexpr, SUB_SCALE: tl.constexpr, SIGN_SHIFT: tl.constexpr,
                        NAN_CODE: tl.constexpr):
        """int32 code of the saturating RNE cast of fp32 ``v``; NaN -> NAN_CODE with v's sign."""
        sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
        r = _round_magnitude(tl.abs(v), M_BITS, EMIN, MAX)
        rb = r.to(tl.int32, bitcast=True)
        re = (rb >> 23) & 0xFF
        normal = ((re - 127 + BIAS) << M_BITS) | ((rb >> (23 - M_BITS)) & ((1 << M_BITS) - 1))
        # below 2^EMIN: r = mantissa * 2^(EMIN - M); SUB_SCALE = 2^(M - EMIN) makes it that integer
        subnormal = (r * SUB_SCALE).to(tl.int32)
        code = tl.where(re >= EMIN + 127, normal, subnormal)
        code = tl.where(v != v, NAN_CODE, code)
        return code | (sign << SIGN_SHIFT)

    @triton.jit
    def _fp8_bits_arith(v, IS_E4M3: tl.constexpr):
        """fp32_to_fp8_bits by fp32 arithmetic and integer bit operations, exact in the interpreter too."""
        if IS_E4M3:
            code = _minifloat_bits(v, 3, -6, 7, 448.0, 512.0, 7, 0x7F)
        else:
            code = _minifloat_bits(v, 2, -14, 15, 57344.0, 65536.0, 7, 0x7F)
        return code

    # On a GPU the conversion instruction: ``.to`` lowers to ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32``
    # (sm89+), the same saturating round-to-nearest-even for every number (±inf saturate too), two
    # elements an instruction, where the arithmetic takes about twenty. Its NaN byte is its own, not
    # necessarily torch's 0x7F|sign. In the interpreter, whose own conversion neither saturates nor
    # rounds correctly, the arithmetic.
    if triton.knobs.runtime.interpret:
        @triton.jit
        def fp8_bits_no_nan(v, IS_E4M3: tl.constexpr):
            """fp32_to_fp8_bits for a ``v`` without NaN (a NaN's byte is the conversion's own)."""
            return _fp8_bits_arith(v, IS_E4M3)
    else:
        @triton.jit
        def fp8_bits_no_nan(v, IS_E4M3: tl.constexpr):
            """fp32_to_fp8_bits for a ``v`` without NaN (a NaN's byte is the conversion's own)."""
            if IS_E4M3:
                code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
            else:
                code = v.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
            return code

    @triton.jit
    def fp8_nan_bits(v, code):
        """``code`` (fp8_bits_no_nan's of ``v``) with each NaN of v as torch's byte 0x7F|sign. A select
        an element, and on a GPU an unpacking of the converted byte pairs: the block quantize kernels
        apply it only to a tile that holds a NaN."""
        sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
        return tl.where(v != v, 0x7F | (sign << 7), code)

    @triton.jit
    def fp32_to_fp8_bits(v, IS_E4M3: tl.constexpr):
        """Byte (as int32) of ``v.clamp(-max, max).to(e4m3fn or e5m2)``: saturating, RNE, NaN -> 0x7F|sign."""
        return fp8_nan_bits(v, fp8_bits_no_nan(v, IS_E4M3))

    @triton.jit
    def nan_max(a, b):
        """Combine function of a max reduction that keeps NaNs as torch.amax does
        (``tl.reduce(v, axis, nan_max)``): ``tl.max`` drops them on a GPU. One fmax.NaN an element."""
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _round_value(v, M_BITS: tl.constexpr, EMIN: tl.constexpr, MAX: tl.constexpr):
        """fp32 value of the saturating RNE cast of ``v`` to a minifloat (NaN stays NaN)."""
        sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
        r = _round_magnitude(tl.abs(v), M_BITS, EMIN, MAX)
        r = (r.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)  # keeps -0.0
        return tl.where(v != v, v, r)

    @triton.jit
    def round_to_e4m3(v):
        """fp32 value of the saturating RNE e4m3fn cast of ``v`` (NaN stays NaN)."""
        return _round_value(v, 3, -6, 448.0)

    @triton.jit
    def round_to_e5m2(v):
        """fp32 value of the saturating RNE e5m2 cast of ``v`` (NaN stays NaN; ±inf saturate)."""
        return _round_value(v, 2, -14, 57344.0)

    # fp32 -> FP8 for a kernel's own FP8 operands (attention's P, dS). On a GPU one conversion
    # instruction: Triton lowers ``.to`` to ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` on sm89+ (Triton 3.6
    # and 3.9 alike), the saturating round-to-nearest-even that round_to_e4m3 / round_to_e5m2 compute in
    # about fifteen instructions an element. In the interpreter the arithmetic rounding first, since its
    # own conversion is neither saturating nor correctly rounded (module docstring).
    if triton.knobs.runtime.interpret:
        @triton.jit
        def to_e4m3(v):
            """``v`` (fp32) as float8_e4m3fn, rounded as the reference's cast rounds."""
            return round_to_e4m3(v).to(tl.float8e4nv)

        @triton.jit
        def to_e5m2(v):
            """``v`` (fp32) as float8_e5m2, rounded as the reference's cast rounds."""
            return round_to_e5m2(v).to(tl.float8e5)
    else:
        @triton.jit
        def to_e4m3(v):
            """``v`` (fp32) as float8_e4m3fn, rounded as the reference's cast rounds."""
            return v.to(tl.float8e4nv)

        @triton.jit
        def to_e5m2(v):
            """``v`` (fp32) as float8_e5m2, rounded as the reference's cast rounds."""
            return v.to(tl.float8e5)

    # Triton decides at decoration time, from this knob (TRITON_INTERPRET), whether kernels run in its
    # interpreter; mul_rn picks its body from the same knob at the same moment.
    if triton.knobs.runtime.interpret:
        @triton.jit
        def mul_rn(a, b):
            """a * b rounded to fp32 (the interpreter never fuses it with a later add)."""
            return a * b
    else:
        @triton.jit
        def mul_rn(a, b):
            """a * b rounded to fp32, never contracted with a later add: ptxas fuses ``a * b + c`` into one
            FMA by default (Triton <= 3.9), which rounds once where torch rounds twice. An explicitly
            rounded PTX multiply is never fused."""
            return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                             is_pure=True, pack=1)

    @triton.jit
    def nan_abs_max(v, mask):
        """max |v| over a tile's ``mask``ed elements (0 when none), NaN if one of them is NaN: GPU
        max-reductions may drop NaNs (torch.amax keeps them), so they are counted apart."""
        has_nan = tl.max(tl.where(mask & (v != v), 1, 0))
        tile_max = tl.max(tl.where(mask & (v == v), tl.abs(v), 0.0))
        return tl.where(has_nan > 0, float("nan"), tile_max)

    @triton.jit
    def round_fp32_to(v, CODE: tl.constexpr):
        """``v.to(dtype).float()`` for dtype code 0 (fp32: v), 1 (bf16), 2 (fp16). The interpreter's
        fp32 -> bf16 conversion truncates; bf16 is rounded here on the fp32 bits instead (nearest
        even, the GPU's rounding), so both agree with torch. NaN stays NaN."""
        if CODE == 1:
            bits = v.to(tl.int32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            v = tl.where(v != v, v, rounded.to(tl.float32, bitcast=True))
        elif CODE == 2:
            v = v.to(tl.float16).to(tl.float32)
        return v

    @triton.jit
    def fp32_to_e2m1_bits(v):
        """E2M1 code 0..15 of ``v`` (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; sign in bit 3): saturating at
        ±6, round half to even; E2M1 has no NaN, so NaN -> 7 (|6|) with v's sign."""
        return _minifloat_bits(v, 1, 0, 1, 6.0, 2.0, 3, 0x7)

    @triton.jit
    def e2m1_magnitude_code(a):
        """E2M1 magnitude code 0..7 of fp32 ``0 <= a <= 6`` (not NaN), round half to even: fp32_to_e2m1_bits's
        code for such an ``a`` in about ten instructions. The grid's spacing is 0.5 below 2, 1 below 4 and
        2 up to 6; within each range the code is an integer rounding of ``a`` scaled by a power of two
        (exact) plus the range's first code, and each range's ties fall on the even code."""
        # each range's a * 2^k + 2^23 + its first code (even, so ties still round to an even code): the
        # sum holds the code in its low mantissa bits, rounded half to even. Immediate powers of two,
        # so an FMA that ptxas makes of them rounds once, as the product is exact.
        low = a * 2.0 + 8388608.0
        mid = a + 8388610.0
        high = a * 0.5 + 8388612.0
        y = tl.where(a < 2.0, low, tl.where(a < 4.0, mid, high))
        return y.to(tl.int32, bitcast=True) & 7

    # min / max that ignore a NaN operand (NaN only when both are): a GPU's min.f32 / max.f32, which
    # tl.minimum / tl.maximum are there; the interpreter's keep NaNs, so it selects around them.
    if triton.knobs.runtime.interpret:
        @triton.jit
        def max_drop_nan(a, b):
            """max(a, b), ignoring a NaN operand."""
            return tl.where(a != a, b, tl.where(b != b, a, tl.maximum(a, b)))

        @triton.jit
        def min_drop_nan(a, b):
            """min(a, b), ignoring a NaN operand."""
            return tl.where(a != a, b, tl.where(b != b, a, tl.minimum(a, b)))
    else:
        @triton.jit
        def max_drop_nan(a, b):
            """max(a, b), ignoring a NaN operand."""
            return tl.maximum(a, b)

        @triton.jit
        def min_drop_nan(a, b):
            """min(a, b), ignoring a NaN operand."""
            return tl.minimum(a, b)

    @triton.jit
    def e2m1_bits_to_fp32(code):
        """fp32 value of an E2M1 code (int32 0..15)."""
        mag = code & 7
        # codes 0, 1: 0 and 0.5 (subnormal); 2..7: 2^((mag >> 1) - 1) * (1 + (mag & 1) / 2)
        exp_bits = ((mag >> 1) - 1 + 127) << 23
        normal = exp_bits.to(tl.float32, bitcast=True) * (1.0 + (mag & 1).to(tl.float32) * 0.5)
        value = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal)
        # the sign as a bit: Triton's unary minus is 0 - x, which makes code 8 +0.0 on a GPU, not -0.0
        sign = ((code >> 3) & 1) << 31
        return (value.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
