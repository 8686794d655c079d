"""Software fp8 for Ampere: e4m3fn and UE8M0 conversions as Triton jit helpers.

Triton refuses ``fp8e4nv`` below sm_89, so the sm80/sm86 kernels decode the e4m3 bytes
with integer arithmetic. Every helper here is exact (bit-identical to torch's
``float8_e4m3fn`` conversions); tests/test_fp8.py checks all 256 codes.

Kernels take a ``HW_FP8: tl.constexpr`` and call ``cvt_e4m3_to_f32(x_u8, HW_FP8)``
(writers: ``cvt_f32_to_e4m3``): on sm89+ the hardware conversion, below it the integer one.
Three other exact decoders (``e4m3_to_f32_lut``, ``e4m3_to_f32_e4b15``,
``e4m3_to_f32_f16bits``) are timed against it by benchmarks/suites/fp8.py; docs/fp8.md
records which one the software path should use.

Scales: ``ue8m0_to_f32`` decodes a UE8M0 byte by bit shift; ``ue8m0_exponent`` computes the
encoder's exponent ``ceil(log2(max(amax, 1e-4) / 448))`` exactly from the fp32 bits of amax.

Torch-level wrappers (``e4m3_decode``, ``e4m3_encode``, ``ue8m0_decode``, ``ue8m0_encode``)
run these helpers on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``; they are
the references other kernels' tests and the docs (docs/fp8.md) point at.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.deepinfer import arch
from vllm.deepinfer.compile_gate import GateSpec, register
from vllm.deepinfer.kernels.checks import check_tensor, fail

__all__ = ["e4m3_to_f32", "e4m3_to_f32_lut", "e4m3_to_f32_e4b15", "e4m3_to_f32_f16bits",
           "ue8m0_to_f32", "cvt_e4m3_to_f32", "f32_to_e4m3", "cvt_f32_to_e4m3", "ue8m0_exponent",
           "e4m3_decode", "e4m3_encode", "e4m3_table", "ue8m0_decode", "ue8m0_encode"]


@triton.jit
def e4m3_to_f32(x):
    """e4m3fn bytes (uint8) -> fp32, exact, with no fp8 type involved.

    Normal codes: the 7 exponent+mantissa bits move to fp32's position and the exponent
    is rebased by 127 - 7 = 120 (added to the shifted field as 120 << 3). Subnormal codes
    (exponent 0) are m * 2^-9, exact in fp32. 0x7F/0xFF are NaN (bits 0x7FF00000 with the
    sign, as torch gives); e4m3fn has no infinity.
    """
    xi = x.to(tl.int32)
    em = xi & 0x7F
    normal = (em + (120 << 3)) << 20
    # NaN as torch's decode gives it: 0x7FF00000 (the hardware cvt's NaN payload may
    # differ; the fp8 suite reports it as nan_bits_equal).
    normal = tl.where(em == 0x7F, 0x7FF00000, normal)
    sub = ((em & 0x7).to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m * 2^-9
    bits = tl.where(em >= 8, normal, sub) | ((xi & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True)


# Alternative exact e4m3 decoders, measured against e4m3_to_f32 and the hardware cvt by
# benchmarks/suites/fp8.py (docs/fp8.md records the choice). All three are exact for every
# code, NaN bits included (tests/test_fp8.py).
@triton.jit
def e4m3_to_f32_lut(x, lut_ptr):
    """Decode by a 256-entry fp32 table (``e4m3_table(device)``): one gathered load per value."""
    return tl.load(lut_ptr + x.to(tl.int32))


@triton.jit
def _e4m3_nan_fixup(xi, f):
    # e4m3fn's 0x7F/0xFF are NaN; the fp16-based decoders below read them as ±480.
    nan = (0x7FF00000 | ((xi & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.where((xi & 0x7F) == 0x7F, nan, f)


@triton.jit
def e4m3_to_f32_e4b15(x):
    """Decode through Triton's fp8e4b15 (compiles for sm_80: Triton converts it with integer
    ops to fp16). e4b15 has e4m3fn's bit layout with bias 15 instead of 7, so its value is
    the e4m3 value * 2^-8, subnormals included; multiplying by 2^8 is exact."""
    f = x.to(tl.float8e4b15, bitcast=True).to(tl.float32) * 256.0
    return _e4m3_nan_fixup(x.to(tl.int32), f)


@triton.jit
def e4m3_to_f32_f16bits(x):
    """The e4b15 idea by hand: the 7 exponent+mantissa bits shifted into an fp16 (bias 15,
    so the fp16 is the value * 2^-8; e4m3 subnormals land on fp16 subnormals), then
    fp16 -> fp32 and * 2^8, both exact."""
    xi = x.to(tl.int32)
    h = ((xi & 0x7F) << 7) | ((xi & 0x80) << 8)
    f = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return _e4m3_nan_fixup(xi, f)


@triton.jit
def ue8m0_to_f32(b):
    """UE8M0 scale byte -> fp32 2^(b-127) by bit shift, exact for every byte.

    Byte 255 gives +inf (what upstream's exp2(128) gives; the OCP MX spec calls it NaN,
    no writer on the V4 path emits it). Byte 0 is 2^-127, an fp32 denormal, built
    explicitly because 0 << 23 is +0.0 (upstream writers never emit it: their scale
    exponent is clamped at ceil(log2(1e-4/448)) = -22, byte 105).
    """
    bi = b.to(tl.int32)
    return tl.where(bi == 0, 0x00400000, bi << 23).to(tl.float32, bitcast=True)


@triton.jit
def cvt_e4m3_to_f32(x, HW_FP8: tl.constexpr):
    """Variant dispatch: hardware conversion on sm89+, integer decode below."""
    if HW_FP8:
        return x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return e4m3_to_f32(x)


@triton.jit
def f32_to_e4m3(x):
    """fp32 -> e4m3fn byte (uint8), round-to-nearest-even, saturating to ±448; NaN -> 0x7F.

    Byte-identical to torch's ``.to(torch.float8_e4m3fn)`` for every input in [-448, 448]
    (the upstream writers clamp to that range first). Beyond it this saturates to ±448
    (±inf too), like the hardware ``cvt.rn.satfinite`` and torch 2.13 on CPU; older torch
    versions return NaN from 464 up. Normal results (|x| >= 2^-6): RNE on the fp32 bits,
    dropping 20 mantissa bits, then the exponent is rebased by 120. Subnormal results:
    |x| * 2^9 rounded to an integer by the add-and-subtract 2^23 trick (fp32 addition
    rounds to nearest even).
    """
    xb = x.to(tl.int32, bitcast=True)
    sign = ((xb >> 24) & 0x80).to(tl.int32)
    ab = xb & 0x7FFFFFFF
    a = ab.to(tl.float32, bitcast=True)
    lsb = (ab >> 20) & 1
    normal = ((ab + 0x7FFFF + lsb) >> 20) - (120 << 3)
    normal = tl.minimum(normal, 0x7E)
    small = a < 0.015625  # 2^-6, the smallest normal e4m3 (false for NaN)
    # Only small inputs enter the subnormal arithmetic (keeps inf/NaN out of the float->int cast).
    sub = ((tl.where(small, a, 0.0) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    mag = tl.where(small, sub, normal)
    mag = tl.where(ab > 0x7F800000, 0x7F, mag)  # NaN
    return (mag | sign).to(tl.uint8)


@triton.jit
def cvt_f32_to_e4m3(x, HW_FP8: tl.constexpr):
    """Variant dispatch for writers: fp32 -> e4m3fn byte. Callers clamp to ±448 first."""
    if HW_FP8:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return f32_to_e4m3(x)


@triton.jit
def ue8m0_exponent(amax):
    """``ceil(log2(max(amax, 1e-4) / 448))`` as int32, exact: no log2, no division.

    With ``a = max(amax, 1e-4) = 1.f * 2^(E-127)`` (a normal fp32), ``a / 448 =
    (1.f / 1.75) * 2^(E-135)`` and ``1.f / 1.75`` lies in [4/7, 8/7): its ceil(log2) is 0
    when ``1.f <= 1.75`` (fraction bits <= 0x600000) and 1 above. So the exponent is
    ``E - 135 + (fraction > 0x600000)``. Range: -22 (amax <= 1e-4) to 120 (largest
    finite fp32); +inf gives 128 (byte 255, as upstream's clamp gives); NaN is treated as
    below the floor (-22), as the GPU's ``fmaxf(NaN, 1e-4)`` does. Upstream computes the
    same formula with fp32 division and ``log2``; docs/fp8.md says where that rounds
    differently (fp32 amax a few ulps above 448 * 2^k; never for bf16 amax).
    """
    a = amax.to(tl.float32)
    a = tl.where(a > 1e-4, a, 1e-4)  # the encoder's floor; NaN fails the compare -> 1e-4
    bits = a.to(tl.int32, bitcast=True)
    # 135 = 127 (fp32 bias) + 8 (448 = 1.75 * 2^8); 0x600000 is the fraction of 1.75.
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.where(bits >= 0x7F800000, 128, e)


# --------------------------------------------------------------------------- torch level
@triton.jit
def _e4m3_decode_kernel(x_ptr, y_ptr, n, HW_FP8: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    tl.store(y_ptr + offs, cvt_e4m3_to_f32(x, HW_FP8), mask=mask)


@triton.jit
def _e4m3_encode_kernel(x_ptr, y_ptr, n, IN_BF16: tl.constexpr, HW_FP8: tl.constexpr,
                        BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    if IN_BF16:
        # bf16 arrives as its int16 bits; bf16 -> fp32 is the bits moved up 16 places (exact,
        # and independent of the interpreter's bf16 handling).
        x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    tl.store(y_ptr + offs, cvt_f32_to_e4m3(x, HW_FP8), mask=mask)


@triton.jit
def _ue8m0_decode_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, ue8m0_to_f32(tl.load(x_ptr + offs, mask=mask, other=0)), mask=mask)


@triton.jit
def _ue8m0_encode_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e = ue8m0_exponent(tl.load(x_ptr + offs, mask=mask, other=1.0))
    tl.store(y_ptr + offs, tl.minimum(tl.maximum(e + 127, 0), 255).to(tl.uint8), mask=mask)


@triton.jit
def _fp8_roundtrip_kernel(x_ptr, y_ptr, n, HW_FP8: tl.constexpr, BLOCK: tl.constexpr):
    """e4m3 bytes -> fp32 -> e4m3 bytes: the smallest kernel using both conversions (gate)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    tl.store(y_ptr + offs, cvt_f32_to_e4m3(cvt_e4m3_to_f32(x, HW_FP8), HW_FP8), mask=mask)


# Elements per program of the converters above, per variant. GPU: 1024 = 4 warps x 32
# threads x 8 elements, a streaming elementwise tile. cpu (Triton interpreter, also used for
# CPU tensors under a forced GPU variant): each program costs ~0.7 ms of fixed overhead and
# numpy is vectorized, so one program takes 64 Ki elements.
_BLOCK: dict[str, int] = {"sm80": 1024, "sm86": 1024, "sm89": 1024, "sm90": 1024,
                          "sm100": 1024, "cpu": 65536}
_NUM_WARPS = 4  # 1024 elements / (4 * 32 threads) = 8 per thread
_NUM_STAGES = 1  # no loop to pipeline

_SW_VARIANTS = ("sm80",)        # compiled for sm_80 and sm_86; software fp8 only
_HW_VARIANTS = ("sm90",)        # hardware e4m3 (sm89 and sm100 launch the same constexprs)


def _gate(name: str, kernel, signature: dict, constexprs: dict, variants: tuple) -> None:
    register(GateSpec(name=name, kernel=kernel, signature=signature, constexprs=constexprs,
                      variants=variants, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
                      feature="fp8_sw"))


for _vs, _hw in ((_SW_VARIANTS, False), (_HW_VARIANTS, True)):
    _tag, _blk = _vs[0], _BLOCK[_vs[0]]
    for _k, _out in ((_fp8_roundtrip_kernel, "*u8"), (_e4m3_decode_kernel, "*fp32")):
        _gate(f"fp8.{_k.__name__}[{_tag}]", _k,
              {"x_ptr": "*u8", "y_ptr": _out, "n": "i32", "HW_FP8": "constexpr",
               "BLOCK": "constexpr"}, {"HW_FP8": _hw, "BLOCK": _blk}, _vs)
    for _bf16 in (False, True):
        _gate(f"fp8._e4m3_encode_kernel[{_tag},{'bf16' if _bf16 else 'fp32'}]",
              _e4m3_encode_kernel,
              {"x_ptr": "*i16" if _bf16 else "*fp32", "y_ptr": "*u8", "n": "i32",
               "IN_BF16": "constexpr", "HW_FP8": "constexpr", "BLOCK": "constexpr"},
              {"IN_BF16": _bf16, "HW_FP8": _hw, "BLOCK": _blk}, _vs)
# The UE8M0 converters have one (integer) path for every variant.
_gate("fp8._ue8m0_decode_kernel", _ue8m0_decode_kernel,
      {"x_ptr": "*u8", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
      {"BLOCK": _BLOCK["sm80"]}, _SW_VARIANTS + _HW_VARIANTS)
_gate("fp8._ue8m0_encode_kernel", _ue8m0_encode_kernel,
      {"x_ptr": "*fp32", "y_ptr": "*u8", "n": "i32", "BLOCK": "constexpr"},
      {"BLOCK": _BLOCK["sm80"]}, _SW_VARIANTS + _HW_VARIANTS)


def _check(name: str, t, dtypes: tuple, variant: str | None) -> tuple[str, bool, int]:
    """Validate tensor ``name`` and the variant; returns (variant, hw_fp8, block)."""
    check_tensor(t, name, dtypes=dtypes)
    if t.device.type == "cpu" and not arch.interpreting():
        fail(name, "a CPU tensor: the Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 "
             "to run on CPU")
    if t.device.type not in ("cpu", "cuda"):
        fail(name, f"on {t.device}; expected a CUDA (or interpreted CPU) tensor")
    v = arch.resolve(variant)
    variant, hw = v.name, v.hw_fp8
    if hw and t.device.type == "cuda":
        cap = torch.cuda.get_device_capability(t.device)
        if cap < (8, 9):
            fail("variant", f"{variant} uses hardware fp8, which {name}'s device "
                 f"(sm_{cap[0]}{cap[1]}) lacks")
    # Tiles follow the device: interpreted CPU tensors take the "cpu" row whatever the
    # variant; on a GPU the "cpu" variant (the software path) takes sm80's.
    tiles = "cpu" if t.device.type == "cpu" else ("sm80" if variant == "cpu" else variant)
    return variant, hw, _BLOCK[tiles]


def _launch(kernel, x: torch.Tensor, out_dtype: torch.dtype, block: int, **constexprs):
    xf = x.contiguous().view(-1)  # a copy only when x is not contiguous
    y = torch.empty(xf.shape, dtype=out_dtype, device=x.device)
    if xf.numel():
        kernel[(triton.cdiv(xf.numel(), block),)](xf, y, xf.numel(), BLOCK=block,
                                                 num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
                                                 **constexprs)
    return y.view(x.shape)


def e4m3_decode(x: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """e4m3fn bytes (uint8, any shape) -> fp32, bit-identical to
    ``x.view(torch.float8_e4m3fn).float()`` (0x7F/0xFF: NaN 0x7FF00000 with the sign)."""
    variant, hw, block = _check("x", x, (torch.uint8,), variant)
    return _launch(_e4m3_decode_kernel, x, torch.float32, block, HW_FP8=hw)


def e4m3_encode(x: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """fp32 or bf16 -> e4m3fn bytes (uint8), round to nearest even.

    Byte-identical to ``x.to(torch.float8_e4m3fn).view(torch.uint8)`` for |x| <= 448.
    Beyond, the software path saturates to ±448 (0x7E/0xFE; ±inf too), as the hardware
    ``cvt.rn.satfinite`` of the sm90 path and torch 2.13 do (older torch: NaN from 464 up).
    NaN -> 0x7F (0xFF with the sign bit set).
    """
    variant, hw, block = _check("x", x, (torch.float32, torch.bfloat16), variant)
    bf16 = x.dtype == torch.bfloat16
    return _launch(_e4m3_encode_kernel, x.view(torch.int16) if bf16 else x, torch.uint8, block,
                   IN_BF16=bf16, HW_FP8=hw)


def e4m3_table(device) -> torch.Tensor:
    """The 256 e4m3fn values as fp32 (torch's decode, NaN bits included), the table of
    ``e4m3_to_f32_lut``."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().to(device)


def ue8m0_decode(b: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """UE8M0 bytes (uint8) -> fp32 ``2^(b-127)``; byte 0 -> 2^-127 (denormal), 255 -> +inf."""
    variant, _, block = _check("b", b, (torch.uint8,), variant)
    return _launch(_ue8m0_decode_kernel, b, torch.float32, block)


def ue8m0_encode(amax: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """Block absmax (fp32) -> UE8M0 byte ``clamp(ceil(log2(max(amax, 1e-4) / 448)) + 127,
    0, 255)``, the exponent computed exactly (``ue8m0_exponent``): bytes 105 (amax <= 1e-4)
    to 247 (largest finite fp32), 255 for +inf."""
    variant, _, block = _check("amax", amax, (torch.float32,), variant)
    return _launch(_ue8m0_encode_kernel, amax, torch.uint8, block)
