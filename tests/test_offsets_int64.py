"""No 32-bit offset left to overflow on the Ampere path.

Every offset product of the path that can pass 2^31 - 1 at a size vLLM accepts (1M tokens per
step, up to 128 heads, caches of tens of millions of tokens) is formed in int64. Each hazard
that was fixed has a boundary case here: inputs whose rows sit ``stride(0)`` elements apart,
so that the last row's offset is just past 2^31 with a grid of a few programs (the Triton
interpreter's int32 arithmetic wraps as the GPU's does). Each case runs in its own process
(tests/offset_probe.py): an offset that wraps reads or writes outside the tensor, which kills
the process, or writes other rows; the case passes only when the far rows come back
bit-identical to the same launch on a compact copy.

* inverse RoPE of the attention output (attention/common.py): upstream's
  ``_inverse_rope_gptj_kernel`` forms ``t * s_t`` in int32 (s_t = heads * 512: 65,536 rows at
  64 heads); ours (kernels/inverse_rope.py) does not, and gives upstream's bytes wherever
  upstream's offsets fit. The upstream boundary case is a strict xfail: it shows the boundary
  case does reach the wrap.
* V4 indexer Q quant (kernels/fp8_writers_v4.py): ``tok * q_stride0`` and ``tok * out_stride0``
  (heads * 128: 262,144 tokens at 64 index heads). The output is allocated by the launcher,
  so its stride cannot be made large; the TTIR check covers its row offset.
* sparse MLA decode (kernels/sparse_mla_decode.py): ``tok * q_stride0`` and ``tok *
  out_stride0`` in the attention kernel (one and two phases) and the reduce (heads * 512:
  65,536 decode tokens at 64 heads).
* V4 compressor (kernels/fp8_writers_v4_compress.py): ``req * block_table_stride`` of the
  state block table (262,144 columns at 1M context with 4-token state pages: 8,192 requests).

The memcheck script benchmarks/diag/long_context_memcheck.py (run on a GPU under
compute-sanitizer) is checked here with --dry-run and at toy sizes under the interpreter.
Run against the code before these fixes, every boundary case of ours crashed (signal 11).
"""
from __future__ import annotations

import ast
import importlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import subproc
import torch

from vllm.deepinfer.kernels import inverse_rope as ir

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "tests" / "offset_probe.py"
MEMCHECK = REPO / "benchmarks" / "diag" / "long_context_memcheck.py"
NOPE, ROPE, D = 448, 64, 512


def _probe(device: str, *args: str) -> dict:
    r = subproc.run([sys.executable, str(PROBE), *args, "--device", device], cap=300)
    assert r.returncode == 0, (f"{' '.join(args)}: exit {r.returncode} (a negative code is "
                               f"the signal that killed it)\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _upstream_built() -> bool:
    return (REPO / "build" / "upstream_kernels" / "__init__.py").is_file()


# ----------------------------------------------------------------------------- boundaries
BOUNDARY_CASES = [
    ("inverse_rope", "ours"),
    pytest.param("inverse_rope", "upstream", marks=[
        pytest.mark.xfail(strict=True, reason="upstream's inverse RoPE offsets are int32"),
        pytest.mark.skipif(not _upstream_built(), reason="build/upstream_kernels missing")]),
    ("indexer_q", "sm80"),
    ("indexer_q", "sm90"),
    ("decode", "direct:q"),
    ("decode", "direct:out"),
    ("decode", "split:out"),
    ("decode", "2p:q"),
    ("decode", "2p:out"),
    ("compress", "512"),
    ("compress", "128"),
]


@pytest.mark.parametrize("case,variant", BOUNDARY_CASES)
def test_offsets_past_int32(device, case, variant):
    r = _probe(device, case, variant)
    assert r["prev_offset"] <= 2 ** 31 - 1 < r["last_offset"], r  # only the last row is past
    assert r["equal"], f"{case} {variant}: rows past 2^31 elements differ from the compact run"


# ----------------------------------------------------------------------------- inverse RoPE
def _rows(tokens, heads, seed, device, *, pad_heads=0, full=False):
    """bf16 [tokens, heads, 512] as a view of [tokens, heads + pad_heads, 512] (the attention
    output's head slice), its positions and a [4096, 64] fp32 cos | sin cache; with ``full``
    also the whole [tokens, heads + pad_heads, 512] tensor."""
    g = torch.Generator().manual_seed(seed)
    whole = (torch.randn(tokens, heads + pad_heads, D, generator=g) * 4).to(torch.bfloat16)
    whole = whole.to(device)
    pos = torch.randint(0, 4096, (tokens,), generator=g)
    ang = torch.rand(4096, ROPE // 2, generator=g) * 6.3
    cs = torch.cat([ang.cos(), ang.sin()], dim=1)
    out = (whole[:, :heads], pos.to(device), cs.to(device))
    return (*out, whole) if full else out


@pytest.fixture
def rne_bf16(monkeypatch, device):
    """Under the interpreter, fp32 -> bf16 rounds to nearest even as a GPU does (the
    interpreter truncates; tests/interp_bf16.py)."""
    if device == "cpu":
        import interp_bf16
        interp_bf16.patch(monkeypatch.setattr)


def _torch_reference(o, pos, cs):
    """The inverse GPT-J rotation in fp32, rounded once to bf16 (no fused multiply-add)."""
    x = o.float().cpu()
    c, s = cs.cpu()[pos.cpu().long(), :ROPE // 2][:, None], cs.cpu()[pos.cpu().long(), ROPE // 2:][:, None]
    a, b = x[..., NOPE::2].clone(), x[..., NOPE + 1::2].clone()
    x[..., NOPE::2] = a * c + b * s
    x[..., NOPE + 1::2] = b * c - a * s
    return x.to(torch.bfloat16)


def _bits(t):
    return t.contiguous().view(torch.int16).cpu()


@pytest.mark.parametrize("tokens,heads,pad,cs_dtype", [
    (3, 64, 0, torch.float32), (5, 20, 4, torch.float32), (2, 8, 0, torch.bfloat16),
    (1, 1, 0, torch.float32)])
def test_inverse_rope_matches_upstream_bits(upstream, device, rne_bf16, tokens, heads, pad,
                                           cs_dtype):
    """Same bytes as upstream's kernel, in place, where upstream's offsets fit: head counts
    inside and across head blocks, a head slice of a wider output (row strides that are not
    heads * 512), a bf16 cos | sin cache."""
    up = importlib.import_module("upstream_kernels.v41_sparse_prefill")
    o, pos, cs, base = _rows(tokens, heads, tokens * 100 + heads, device, pad_heads=pad,
                             full=True)
    cs = cs.to(cs_dtype)
    theirs = o.clone()
    up._inverse_rope_gptj_kernel[(tokens, heads)](
        theirs, theirs, pos, cs, theirs.stride(0), theirs.stride(1), theirs.stride(0),
        theirs.stride(1), cs.stride(0), NOPE=NOPE, HALF=ROPE // 2, BLOCK_NOPE=512,
        BLOCK_HALF=ROPE // 2)
    before = base.clone()
    ir.inverse_rope_rows_(o, pos, cs, ROPE)
    assert torch.equal(_bits(o), _bits(theirs))
    if pad:  # the heads outside the slice are not touched
        assert torch.equal(_bits(base[:, heads:]), _bits(before[:, heads:]))


def test_inverse_rope_matches_torch_reference(device, rne_bf16):
    o, pos, cs = _rows(4, 24, 9, device)
    want = _torch_reference(o, pos, cs)
    ir.inverse_rope_rows_(o, pos, cs, ROPE)
    if device == "cpu":  # numpy and torch: the same fp32 operations, one rounding
        assert torch.equal(_bits(o), _bits(want))
    else:  # a fused multiply-add may differ in the last bf16 bit
        assert (o.float().cpu() - want.float()).abs().max() <= 2 ** -6 * want.float().abs().max()
    assert torch.equal(_bits(o[..., :NOPE]), _bits(want[..., :NOPE]))


def test_inverse_rope_int32_positions_and_empty(device):
    o, pos, cs = _rows(3, 16, 4, device)
    ref = o.clone()
    ir.inverse_rope_rows_(ref, pos, cs, ROPE)
    ir.inverse_rope_rows_(o, pos.to(torch.int32), cs, ROPE)
    assert torch.equal(_bits(o), _bits(ref))
    empty = o[:0]
    ir.inverse_rope_rows_(empty, pos[:0], cs, ROPE)  # no launch, no error


@pytest.mark.parametrize("mutate,match", [
    (lambda o, p, c, r: (o.float(), p, c, r), r"^o: dtype torch.float32"),
    (lambda o, p, c, r: (o.transpose(1, 2), p, c, r), r"^o: needs a contiguous last dim"),
    (lambda o, p, c, r: (o, p[:1], c, r), r"^positions: 1 positions for 3 rows"),
    (lambda o, p, c, r: (o, p.float(), c, r), r"^positions: dtype torch.float32"),
    (lambda o, p, c, r: (o, p, c[:, :32], r), r"^cos_sin_cache: expected \[max_pos, 64\]"),
    (lambda o, p, c, r: (o, p, c, 63), r"^rope_head_dim: 63: expected an even int"),
    (lambda o, p, c, r: (o, p, c, 1024), r"^rope_head_dim: 1024: expected an even int"),
])
def test_inverse_rope_validation_names_the_tensor(device, mutate, match):
    args = mutate(*_rows(3, 4, 1, device), ROPE)
    with pytest.raises(ValueError, match=match):
        ir.inverse_rope_rows_(*args)


def test_ampere_attention_calls_the_int64_inverse_rope():
    """attention/common.py rotates the rows no decode epilogue rotated with ours; upstream's
    int32 kernel (rocm_inverse_rope_rows_) is neither imported nor called."""
    src = (REPO / "overlay" / "vllm" / "deepinfer" / "attention" / "common.py").read_text()
    tree = ast.parse(src)
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                for a in n.names}
    called = {n.func.id for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "rocm_inverse_rope_rows_" not in imported | called
    assert "inverse_rope_rows_" in imported and "inverse_rope_rows_" in called
    assert any(isinstance(n, ast.ImportFrom) and n.module == "vllm.deepinfer.kernels.inverse_rope"
               for n in ast.walk(tree))


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="launches are recorded from the interpreter's kernels (CPU)")
@pytest.mark.parametrize("variant,cc", [("sm80", 80), ("sm90", 90)])
def test_inverse_rope_launches_are_warmed(variant, cc):
    """Every launch attention/common.py makes (the rows after ``rotated`` decode rows, 64 / TP
    heads) finds the key vllm.deepinfer.warmup compiles for the ampere_attn feature."""
    from launch_keys import describe, key_of, recording
    from vllm.deepinfer import warmup as wu
    warm = set()
    for k in wu.keys(wu.ModelShapes(window=128, compress_ratios=(0, 1, 2), topk=512, heads=64),
                     variant, features=["ampere_attn"]):
        if k.kernel != "inverse_rope":  # the feature's other keys: tests/test_int32_hazards.py
            continue
        kern, _ = wu._kernel_and_signature(k.kernel)
        args, ce = wu.warmup_args(k)
        warm.add(key_of(kern, args, dict(ce, **wu.launch_options(k)), cc))
    assert len(warm) == 1
    cs = torch.zeros(4096, ROPE)
    with recording(cc) as seen:
        for tp, tokens, rotated in itertools.product((1, 2, 4, 8), (1, 7, 64), (0, 1, 3)):
            heads = 64 // tp
            out = torch.zeros(rotated + tokens, heads, D, dtype=torch.bfloat16)
            pos = torch.zeros(rotated + tokens, dtype=torch.int64)
            ir.inverse_rope_rows_(out[rotated:, :heads], pos[rotated:], cs, ROPE)
    assert seen and {k.fn.__name__ for k, _ in seen} == {"_inverse_rope_rows_kernel"}
    missing = sorted({describe(k, key) for k, key in seen if key not in warm})
    assert not missing, "\n".join(missing)


# ----------------------------------------------------------------------------- compiled offsets
_TTIR_CODE = r"""
import json, re
from vllm.deepinfer import compile_gate as cg
out = {}
for s in cg.specs():
    if s.name in ("fp8_writers.v4.indexer_q_rope_quant[sm80]", "inverse_rope_rows"):
        ttir = cg.compile_spec(s, 80).asm["ttir"]
        out[s.name] = {
            "pid_x": re.findall(r"(%\S+) = tt.get_program_id x : i32", ttir),
            "extsi": re.findall(r"arith.extsi (%\S+) : i32 to i64", ttir)}
print(json.dumps(out))
"""


def test_program_ids_widen_before_strides():
    """Compiled for sm_80, the indexer Q kernel (whose output rows the boundary case cannot
    place far apart) and the inverse RoPE sign-extend their token program id to i64: the row
    offsets built from it are 64-bit products."""
    from compiled import run_json
    got = run_json(_TTIR_CODE)
    assert set(got) == {"fp8_writers.v4.indexer_q_rope_quant[sm80]", "inverse_rope_rows"}
    for name, r in got.items():
        assert len(r["pid_x"]) == 1 and r["pid_x"][0] in r["extsi"], (name, r)


# ----------------------------------------------------------------------------- memcheck script
def _memcheck(*args: str, cap: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "overlay"))
    return subproc.run([sys.executable, str(MEMCHECK), *args], env=env, cap=cap)


def test_memcheck_dry_run_plans_every_kernel(tmp_path):
    out = tmp_path / "plan.json"
    r = _memcheck("--dry-run", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    mod = _load_memcheck()
    doc = json.loads(out.read_text())
    assert doc["meta"]["dry_run"] is True
    rows = doc["rows"]
    assert {row["kernel"] for row in rows} == set(mod.KERNELS)
    assert all(row["ok"] is None for row in rows)
    groups = {row["group"] for row in rows}
    assert {"prefill-300k", "decode-1m", "boundary"} <= groups
    # The plan is the sizes the brief names: a 131,072-token step at 64 heads, 256 decode
    # tokens at 1M context, and each fixed product just past 2^31.
    pre = [row for row in rows if row["group"] == "prefill-300k"]
    assert any(row["shape"].get("tokens") == 131072 and row["shape"].get("heads") == 64
               for row in pre)
    dec = [row for row in rows if row["group"] == "decode-1m"]
    assert {row["shape"].get("context") for row in dec if "context" in row["shape"]} == {1 << 20}
    assert all(row["shape"]["tokens"] == 256 for row in dec if row["kernel"] == "sparse_mla_decode")
    for row in rows:
        if row["group"] == "boundary":
            assert row["shape"]["max_offset"] > 2 ** 31 - 1, row
    assert "kernel" in r.stdout and "131072" in r.stdout


def _load_memcheck():
    spec = importlib.util.spec_from_file_location("long_context_memcheck", MEMCHECK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("long_context_memcheck", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="the toy run is the CPU (interpreter) check")
def test_memcheck_toy_run_launches_every_kernel(tmp_path):
    """The script's launches and spot checks at toy sizes, on CPU under the interpreter: every
    row ran and its spot check (where it has one) matched."""
    out = tmp_path / "toy.json"
    r = _memcheck("--toy", "--out", str(out), cap=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    bad = [row for row in doc["rows"] if row["ok"] is not True]
    assert not bad, bad
    assert {row["kernel"] for row in doc["rows"]} == set(_load_memcheck().KERNELS)
