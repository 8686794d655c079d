"""What the probe scenarios share (tests/vllm_import_probe.py and the vllm_probe_* modules):
a faked device capability, env switches, tiny V4.1/V4 configs, a one-process distributed
group, a CPU platform that vLLM's selection code sees as SM80. Imports vLLM only inside
functions (the test process imports the probe module for its scenario list)."""
from __future__ import annotations

import os
from types import SimpleNamespace


# --------------------------------------------------------------------------- platform
def fake_capability(major: int | None, minor: int = 0) -> None:
    """Make vLLM's current platform report a CUDA device of this capability."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    cap = None if major is None else DeviceCapability(major, minor)
    current_platform.get_device_capability = lambda device_id=0: cap  # type: ignore


def set_env(**kv) -> None:
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def hf_config(model: str):
    """A tiny config of ``model`` (every field the V4.1/V4 attention layers read)."""
    common = dict(
        hidden_size=256, num_attention_heads=8, q_lora_rank=128, o_lora_rank=128,
        head_dim=512, qk_rope_head_dim=64, o_groups=2, sliding_window=128,
        rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        index_topk=64, index_n_heads=4, index_head_dim=128, hc_mult=4,
    )
    if model == "deepseek_v41":
        return SimpleNamespace(
            **common, num_hidden_layers=4, compress_ratios=[0, 1, 2, 1],
            kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2],
            candidate_source_layer_id=-1, candidate_topk_blocks=0, candidate_block_size=0)
    return SimpleNamespace(
        **common, num_hidden_layers=3,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        compress_rates={"sliding_attention": 0, "compressed_sparse_attention": 4,
                        "heavily_compressed_attention": 128})


def vllm_config(model: str):
    from vllm.config import DeviceConfig, VllmConfig
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    cfg.model_config = SimpleNamespace(hf_config=hf_config(model), max_model_len=4096,
                                       dtype="bfloat16")
    cfg.cache_config.cache_dtype = "fp8_ds_mla"
    # Set by VllmConfig's model-dependent post-init on a real model.
    cfg.attention_config.sparse_mla_prefill_workspace_factor = 5
    return cfg


def dist_init(tmpdir: str, vcfg) -> None:
    """A one-process gloo group (file rendezvous: no network), TP = PP = 1."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    with set_current_vllm_config(vcfg):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"file://{tmpdir}/dist")
        ps.ensure_model_parallel_initialized(1, 1)


class _FakeEvent:
    """torch.cuda.Event cannot be instantiated on a CPU-only torch; the layers only
    create theirs at construction."""

    def __init__(self, *a, **k):
        pass


def cpu_platform() -> None:
    """An SM80 device as far as vLLM's selection code asks, CPU tensors for the rest."""
    import torch
    torch.cuda.Event = _FakeEvent  # type: ignore[misc]
    # vLLM's workspace manager empties the accelerator cache when it grows.
    torch.accelerator.empty_cache = lambda: None  # type: ignore[assignment]
    fake_capability(8, 0)
    from vllm.platforms import current_platform
    current_platform.device_type = "cpu"  # V4's compressor allocates on it
