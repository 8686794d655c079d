"""Speculative decoding's limits on the Ampere path (overlay/vllm/deepinfer/spec.py): the one
limit that depends on k, checked at engine start, and the shared memory that does not.

* ``spec.check`` in-process: the configurations served (DSpark k = 5, MTP k = 1 at the e2e and
  long-context limits) pass; past the decode index lists' int32 limit a configuration is
  refused with one line naming the limit and the nearest setting, which does fit (the next
  k up does not); when no k fits, the largest max_num_seqs that does.
* tests/spec_limits_probe.py on the patched tree: the Ampere layers refuse such a
  configuration at construction (``_ampere_init``, engine start) and build for DSpark k = 5;
  spec's DSpark width is upstream's get_dspark_swa_index_width; and every Triton kernel
  whose compile-time constants depend on k, built for sm_80 at k = 1..32, stays within the
  48 KiB budget with the same shared memory at every k (no k-dependent smem exists here).
  MTP on V4.1 is refused by vLLM itself: tests/test_ckpt_spec.py checks its message.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

import subproc
from vllm.deepinfer import reserve, spec

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).with_name("spec_limits_probe.py")
SMEM_BUDGET = 48 * 1024  # arch.VARIANTS["sm80"].smem_budget


def _limits(**kw) -> reserve.Limits:
    base = dict(max_num_batched_tokens=8192, max_num_seqs=256, num_speculative_tokens=5,
                max_capture_size=512, max_model_len=65536, dspark=True)
    return reserve.Limits(**{**base, **kw})


@pytest.mark.parametrize("kw,topk", [
    ({}, 512),                                                     # v41 DSpark k = 5
    ({"num_speculative_tokens": 1, "dspark": False}, 512),         # V4 MTP
    ({"max_num_batched_tokens": 1 << 20, "max_num_seqs": 1024,
      "max_model_len": 1 << 20}, 8192),                            # 1M context, C128A width
])
def test_served_configurations_pass(kw, topk):
    spec.check(_limits(**kw), 128, topk)


def test_dspark_width_is_upstreams_formula():
    # The in-process fallback (no vLLM here); the probe compares it with upstream's.
    assert [spec.dspark_swa_width(128, k) for k in (1, 5, 7, 64, 65)] == [192, 192, 192, 192,
                                                                         256]


def test_refusal_names_the_limit_and_the_nearest_k():
    # 2^15 sequences x (1 + 7) tokens x 8192 top-k columns = 2^31 entries: one past the limit.
    lim = _limits(max_num_batched_tokens=1 << 22, max_num_seqs=1 << 15, num_speculative_tokens=7)
    assert spec.list_entries(lim, 128, 8192) == 1 << 31
    with pytest.raises(spec.SpeculativeLimitError) as e:
        spec.check(lim, 128, 8192, "model.layers.7.attn")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("DeepInfer Ampere attention model.layers.7.attn: DSpark with "
                          "num_speculative_tokens=7 gives 262144 decode tokens per step x "
                          "8192 index columns = 2147483648 entries")
    assert "2^31 - 1" in msg
    assert msg.endswith("nearest setting: num_speculative_tokens=6 fits at max_num_seqs=32768")
    # The nearest setting fits; nothing between it and the refused one does.
    spec.check(_limits(max_num_batched_tokens=1 << 22, max_num_seqs=1 << 15,
                       num_speculative_tokens=6), 128, 8192)


def test_refusal_when_no_k_fits_names_max_num_seqs():
    lim = _limits(max_num_batched_tokens=1 << 24, max_num_seqs=1 << 18, num_speculative_tokens=3)
    with pytest.raises(spec.SpeculativeLimitError, match=r"max_num_seqs=65535 fits at "
                       r"num_speculative_tokens=3$"):
        spec.check(lim, 128, 8192)
    assert spec.list_entries(_limits(max_num_batched_tokens=1 << 24, max_num_seqs=65535,
                                     num_speculative_tokens=3), 128, 8192) <= spec.INT32_MAX
    assert spec.list_entries(_limits(max_num_batched_tokens=1 << 24, max_num_seqs=65536,
                                     num_speculative_tokens=3), 128, 8192) > spec.INT32_MAX


def test_no_speculation_is_never_refused():
    spec.check(_limits(max_num_batched_tokens=1 << 24, max_num_seqs=1 << 24,
                       num_speculative_tokens=0, dspark=False), 128, 8192)


# --------------------------------------------------------------------------- patched tree
@pytest.fixture(scope="module")
def probe():
    from test_vllm_import import _need_tree, _probe_env
    _need_tree()
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    d = Path(tempfile.gettempdir()) / f"deepinfer-spec-limits-{run}"
    d.mkdir(exist_ok=True)
    out = d / "result.json"
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            r = subproc.run([sys.executable, str(PROBE)], env=_probe_env(), cwd=REPO, cap=600)
            lines = r.stdout.strip().splitlines()
            if r.returncode != 0 or not lines:
                pytest.fail(f"spec limits probe failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
            out.write_text(lines[-1])
    res = json.loads(out.read_text())
    assert "error" not in res, f"{res.get('error')}\n{res.get('trace')}"
    return res


def test_layers_refuse_at_construction(probe):
    c = probe["construct"]
    assert c["v41_swa_k5"]["error"] is None and c["v41_swa_k5"]["ratio"] == 0
    assert c["v4_c128a_k5"]["error"] is None and c["v4_c128a_k5"]["ratio"] == 128
    assert c["v41_swa_k5"]["decode_tokens"] == 256 * 6
    for key in ("v41_swa_k7_huge", "v4_swa_k7_huge"):
        assert c[key]["error"] == "SpeculativeLimitError", c[key]
        msg = c[key]["message"]
        assert "\n" not in msg and "model.layers.0.attn" in msg
        # 2^21 x 8 tokens x 192 non-causal columns; k = 4 (2^21 x 5 x 192) fits.
        assert "16777216 decode tokens per step x 192 index columns" in msg
        assert msg.endswith("nearest setting: num_speculative_tokens=4 fits at "
                            "max_num_seqs=2097152")


def test_dspark_width_matches_upstream(probe):
    assert probe["dspark_width"] == {k: -(-(128 + int(k)) // 64) * 64
                                     for k in probe["dspark_width"]}
    for k, w in probe["dspark_width"].items():
        assert w == spec.dspark_swa_width(128, int(k))


def test_no_kernel_shared_memory_grows_with_k(probe):
    smem = probe["smem"]
    assert sorted(map(int, smem)) == [1, 2, 5, 7, 8, 16, 32]
    kernels = set(smem["1"])
    assert len(kernels) == 4
    for name in kernels:
        per_k = [smem[k][name] for k in smem]
        assert max(per_k) <= SMEM_BUDGET, (name, per_k)
        assert max(per_k) - min(per_k) <= 64, (name, per_k)  # bytes: no k-sized buffer
