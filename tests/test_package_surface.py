"""The shared pieces every kernel family uses, and the package's declared public surface.

* ``__all__``: every kernel module, ``routing``, ``kv_record``, ``arch`` declares one; every
  name in it exists, and every public function or class a kernel module defines is in it.
* ``kernels.checks``: messages are built only on failure; each failure is one line naming
  the argument.
* ``arch.resolve`` / ``arch.sm_count``: the one variant and SM-count helper, used by every
  kernel module (no module keeps its own copy).
* ``kv_record``: the vectorized record reference round-trips, on padded and odd-sized pages.
* ``kernels.shapes``: the named production shapes the compile gate builds.
"""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import torch

from edges import INT32_MAX, ODD_PAGES
from vllm.deepinfer import arch, compile_gate, kv_record
from vllm.deepinfer.kernels import checks, shapes

PKG = Path(kv_record.__file__).resolve().parent
KERNEL_MODULES = sorted(p.stem for p in (PKG / "kernels").glob("*.py") if p.stem != "__init__")
SURFACE = [f"vllm.deepinfer.kernels.{m}" for m in KERNEL_MODULES] + [
    "vllm.deepinfer.routing", "vllm.deepinfer.kv_record", "vllm.deepinfer.arch",
    "vllm.deepinfer.fp8", "vllm.deepinfer.yoco"]
# Modules that launch kernels, each with a ``variant=`` argument resolved by arch.resolve.
LAUNCHERS = ("fp8_writers_v4", "fp8_writers_v41", "fp8_writers_v4_compress", "indexer_logits",
             "kv_gather", "sparse_mla_decode", "sparse_mla_prefill", "topk_swa")


@pytest.mark.parametrize("name", SURFACE)
def test_all_is_declared_and_complete(name):
    m = importlib.import_module(name)
    assert isinstance(getattr(m, "__all__", None), list), f"{name} has no __all__"
    missing = [n for n in m.__all__ if not hasattr(m, n)]
    assert not missing, f"{name}.__all__ names what it lacks: {missing}"
    assert len(set(m.__all__)) == len(m.__all__)
    if name.startswith("vllm.deepinfer.kernels."):
        defined = [n for n, v in vars(m).items()
                   if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
                   and getattr(v, "__module__", None) == name]
        undeclared = sorted(set(defined) - set(m.__all__))
        assert not undeclared, f"{name} defines public {undeclared} outside __all__"


def test_one_variant_and_sm_count_helper():
    """Only arch.py reads the SM count or formats an unknown-variant error; every launcher
    module calls arch.resolve."""
    for p in sorted(PKG.rglob("*.py")):
        src = p.read_text()
        if p.name != "arch.py":
            assert "multi_processor_count" not in src, p
            assert "is not one of {', '.join(" not in src or p.name == "shapes.py", p
    for m in LAUNCHERS:
        src = (PKG / "kernels" / f"{m}.py").read_text()
        assert "arch.resolve(" in src or "arch.table_key(" in src, m
    assert "arch.resolve(" in (PKG / "fp8.py").read_text()


def test_arch_resolve_and_sm_count():
    assert arch.resolve("sm80").hw_fp8 is False and arch.resolve("sm90").hw_fp8 is True
    assert arch.resolve(None) is arch.current()
    with pytest.raises(ValueError, match=r"^variant: 'sm75' is not one of sm80, sm86"):
        arch.resolve("sm75")
    with pytest.raises(ValueError, match=r"^variant: 'sm89' is not one of a, sm80$"):
        arch.resolve("sm89", {"a": 1, "sm80": 2})
    assert arch.sm_count(torch.device("cpu")) == arch.INTERPRETER_SMS
    # Tables keyed by variant accept rows of their own (benchmark rows), by key only.
    assert arch.table_key("sm80-int", {"sm80-int": 1}) == "sm80-int"
    assert arch.table_key(None, arch.VARIANTS) == arch.current().name


def test_check_builds_messages_only_on_failure():
    called = []
    checks.check(True, "x", lambda: called.append(1) or "never")
    assert not called
    with pytest.raises(ValueError, match=r"^x: bad 3$"):
        checks.check(False, "x", lambda: f"bad {1 + 2}")
    with pytest.raises(ValueError, match=r"^y: plain$"):
        checks.check(False, "y", "plain")


@pytest.mark.parametrize("value,kw,match", [
    (None, {}, r"^t: expected a torch.Tensor, got NoneType$"),
    (torch.zeros(2), dict(dtypes=(torch.int32, torch.int64)),
     r"^t: dtype torch.float32, expected torch.int32 or torch.int64$"),
    (torch.zeros(2), dict(ndim=2), r"^t: expected 2 dims, got shape \(2,\)$"),
    (torch.zeros(2), dict(device=torch.device("meta")), r"^t: on cpu, expected meta$"),
])
def test_check_tensor_names_the_failing_condition(value, kw, match):
    with pytest.raises(ValueError, match=match):
        checks.check_tensor(value, "t", **kw)
    checks.check_tensor(torch.zeros(2, dtype=torch.int32), "t", dtypes=checks.INDEX_DTYPES,
                        ndim=1, device=torch.device("cpu"))


@pytest.mark.parametrize("page", (32,) + ODD_PAGES)
def test_kv_record_round_trip(page):
    """insert_rows -> read_rows equals the quantizer's values (exact: e4m3 * 2^k), on pages one
    odd pad apart; read_records/pack_records agree; untouched records stay zero."""
    g = torch.Generator().manual_seed(page)
    blocks, pad = 5, 24
    raw = torch.zeros(blocks * (page * kv_record.RECORD_BYTES + pad), dtype=torch.uint8)
    cache = raw.as_strided((blocks, page, kv_record.RECORD_BYTES),
                           (page * kv_record.RECORD_BYTES + pad, kv_record.RECORD_BYTES, 1))
    slots = torch.randperm(blocks * page, generator=g)[: 3 * page // 2 + 1]
    k = torch.randn(len(slots), kv_record.HEAD_DIM, generator=g) * 3
    kv_record.insert_rows(cache, slots, k)
    nope, scales, rope = kv_record.quantize_rows(k)
    assert torch.equal(kv_record.read_records(cache, slots), kv_record.pack_records(nope, scales, rope))
    got = kv_record.read_rows(cache, slots)
    want_nope = (nope.view(torch.float8_e4m3fn).float().view(-1, 7, 64)
                 * torch.exp2(scales[:, :7].double() - 127).float()[..., None]).view(-1, 448)
    assert torch.equal(got[:, :448], want_nope)
    assert torch.equal(got[:, 448:], rope.float())
    rest = torch.tensor([s for s in range(blocks * page) if s not in set(slots.tolist())])
    assert not kv_record.read_records(cache, rest).any()
    # Pads between pages are never written.
    pads = raw.view(blocks, -1)[:, page * kv_record.RECORD_BYTES:]
    assert not pads.any()


def test_dequantize_records_scale_bytes_and_nan():
    """Scale byte 0 is the fp32 subnormal 2^-127, byte 255 gives inf; NaN codes (0x7F) read as
    NaN, or 0 with scrub_nan."""
    rec = torch.zeros(3, kv_record.RECORD_BYTES, dtype=torch.uint8)
    rec[:, 0] = 0x38  # e4m3 1.0
    rec[:, kv_record.DATA_BYTES] = torch.tensor([0, 255, 127], dtype=torch.uint8)
    rec[2, 1] = 0x7F
    x = kv_record.dequantize_records(rec)
    assert x[0, 0].item() == 2.0 ** -127 and x[1, 0].item() == float("inf")
    assert x[2, 0].item() == 1.0 and x[2, 1].isnan()
    assert kv_record.dequantize_records(rec, scrub_nan=True)[2, 1].item() == 0.0


@pytest.mark.parametrize("page", (64,) + ODD_PAGES)
def test_index_rows_round_trip(page):
    g = torch.Generator().manual_seed(page)
    blocks = 4
    cache = kv_record.new_index_cache(blocks, page)
    slots = torch.randperm(blocks * page, generator=g)[:page + 1]
    codes = torch.randint(0, 256, (len(slots), kv_record.INDEX_HEAD_DIM), generator=g,
                          dtype=torch.uint8)
    scales = torch.rand(len(slots), generator=g)
    kv_record.write_index_rows(cache, slots, codes, scales)
    c, s = kv_record.read_index_rows(cache, slots)
    assert torch.equal(c, codes) and torch.equal(s, scales)
    # Layout: a page's codes first, then its fp32 scales.
    p, r = divmod(int(slots[0]), page)
    flat = cache[p].reshape(-1)
    assert torch.equal(flat[r * 128:(r + 1) * 128], codes[0])
    assert torch.equal(flat[page * 128 + 4 * r: page * 128 + 4 * r + 4].view(torch.float32),
                       scales[:1])


def test_slot_coords_of_extremes():
    page, row = kv_record.slot_coords(torch.tensor([INT32_MAX, 69 * 3 + 5]), 69)
    assert page.tolist() == [INT32_MAX // 69, 3] and row.tolist() == [INT32_MAX % 69, 5]


def test_production_shapes():
    names = [s.name for s in shapes.PRODUCTION]
    assert len(set(names)) == len(names)
    assert shapes.by_name("v4.c128a").topk == 8192 and shapes.by_name("v41.c1").keys == 640
    with pytest.raises(ValueError, match="^shape: 'v5' is not one of"):
        shapes.by_name("v5")
    for s in shapes.PRODUCTION:
        assert s.ratio in s.model.ratios and (s.topk > 0) == (s.ratio > 0)
    assert set(shapes.COMPRESSED_PAGE) == set(arch.VARIANTS)
    # The compile gate builds the decode at the production pages.
    decode = [s for s in compile_gate.specs() if s.name.startswith("sparse_mla_decode.direct")]
    assert decode and all(s.constexprs["MAIN_BS"] == shapes.SWA_PAGE
                          and s.constexprs["EXTRA_BS"] == shapes.compressed_page("sm80")
                          for s in decode)
