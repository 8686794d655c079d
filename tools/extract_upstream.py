#!/usr/bin/env python3
"""Extract upstream vLLM @triton.jit kernels from the pinned source into importable modules.

    python tools/extract_upstream.py [--tree build/vllm-0.33.0] [--out build/upstream_kernels]

Tests and benchmarks compare our kernels with the real vLLM 0.33.0 code without installing
vLLM (the GPU machine has none). For each entry of ``UPSTREAM_KERNELS`` the named function
(``Class.method`` for a kernel kept as a staticmethod) is cut out of the source file by
``ast``, together with the module-level helpers and constants it uses, followed across
``from vllm... import`` lines into other upstream files. The result is written, unchanged
apart from dropping ``@staticmethod``, to ``<out>/<module>.py`` with a header naming the
source file and its sha256. Triton needs a real source file, hence the generated module.
The generated files are build outputs and are never committed.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BUILD, UPSTREAM_TREE, VLLM_VERSION, ToolError, run_main, sha256_file  # noqa: E402

# generated module name -> (upstream file, [qualified names of the kernels to extract])
UPSTREAM_KERNELS: dict[str, tuple[str, list[str]]] = {
    "v41_cache_utils": ("vllm/models/deepseek_v41/common/ops/cache_utils.py", [
        "_dequantize_and_gather_k_kernel",
        "CombineTopkSwaIndicesKernel.kernel",
        "quantize_and_insert_k_kernel",
        # The decode's global top-k translation (compute_global_topk_indices_and_lens),
        # which benchmarks/yoco_stack.py times per layer with reuse off and per group on.
        "_compute_global_topk_indices_and_lens_kernel",
    ]),
    "v4_cache_utils": ("vllm/models/deepseek_v4/common/ops/cache_utils.py", [
        "DequantizeAndGatherKCacheKernel.kernel",
        "CombineTopkSwaIndicesKernel.kernel",
    ]),
    "v4_rocm_combine": ("vllm/models/deepseek_v4/amd/rocm.py", [
        "_combine_topk_swa_indices_kernel",
    ]),
    "mla_sparse_decode": ("vllm/v1/attention/ops/rocm_aiter_mla_sparse.py", [
        "_sparse_attn_decode_ragged_kernel",
        "_sparse_attn_decode_partial_kernel",
        "_sparse_attn_decode_reduce_kernel",
    ]),
    # The bf16 sparse prefill of the ROCm Triton path (what ``_rocm_sparse_attn_prefill_triton``
    # runs: dense -> ragged index compaction, then the ragged kernel) and its inverse RoPE;
    # used by benchmarks/one_layer.py (no fp8 in any of them).
    "v41_sparse_prefill": ("vllm/v1/attention/ops/rocm_aiter_mla_sparse.py", [
        "_count_valid_row_entries_kernel",
        "_compact_dense_row_to_ragged_kernel",
        "_sparse_attn_prefill_ragged_kernel",
        "_inverse_rope_gptj_kernel",
    ]),
    "v41_fused_compress": ("vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py", [
        "_rope_quant_insert_kernel",
    ]),
    "v41_indexer_k_store": ("vllm/models/deepseek_v41/common/ops/indexer_k_store.py", [
        "_indexer_k_norm_rope_quant_store_kernel",
    ]),
    "v4_inv_rope_fp8": ("vllm/models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py", [
        "FusedInvRopeFP8QuantKernel.kernel",
    ]),
    "v4_fused_indexer_q": ("vllm/models/deepseek_v4/common/ops/fused_indexer_q.py", [
        "FusedIndexerQRopeQuantTritonKernel.kernel",
    ]),
    # V4.1's candidate-block mask (apply_candidate_mask's two kernels), which
    # tests/test_candidate_logits.py and the indexer_logits suite run after the full logits
    # as the reference for the candidate-only logits.
    "dsa_candidate_blocks": ("vllm/model_executor/kernels/attention/dsa/candidate_blocks.py", [
        "_candidate_flags_kernel",
        "_mask_candidates_kernel",
    ]),
    "v4_fused_compress": ("vllm/models/deepseek_v4/common/ops/fused_compress_quant_cache.py", [
        "_fused_kv_compress_norm_rope_insert_sparse_attn",
        "_fused_kv_compress_norm_rope_insert_indexer_attn",
    ]),
}

HEADER_IMPORTS = ["import torch", "import triton", "import triton.language as tl"]
# Names provided by HEADER_IMPORTS (vllm.triton_utils re-exports triton and tl).
PROVIDED = {"torch", "triton", "tl"}
BUILTINS = set(dir(__builtins__)) if isinstance(__builtins__, dict) is False else set(__builtins__)


class _Module:
    """One parsed upstream file: its top-level definitions and its vllm imports."""

    def __init__(self, tree_root: Path, rel: str):
        self.rel = rel
        self.path = tree_root / rel
        if not self.path.is_file():
            raise ToolError(f"upstream file {rel} not found under {tree_root}")
        self.source = self.path.read_text()
        self.ast = ast.parse(self.source)
        self.defs: dict[str, ast.stmt] = {}
        self.imports: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
        for node in self.ast.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        self.defs[t.id] = node
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
                for a in node.names:
                    self.imports[a.asname or a.name] = (node.module, a.name)

    def lookup(self, qualname: str) -> ast.stmt:
        head, _, rest = qualname.partition(".")
        node = self.defs.get(head)
        if node is None:
            raise ToolError(f"{qualname} not found in {self.rel}")
        if rest:
            for sub in getattr(node, "body", []):
                if isinstance(sub, ast.FunctionDef) and sub.name == rest:
                    return sub
            raise ToolError(f"{qualname} not found in {self.rel}")
        return node


def _used_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


class Extractor:
    def __init__(self, tree_root: Path):
        self.root = tree_root
        self.modules: dict[str, _Module] = {}
        self.emitted: dict[tuple[str, str], str] = {}  # (file, name) -> emitted name
        self.chunks: list[str] = []
        self.sources: dict[str, str] = {}

    def module(self, rel: str) -> _Module:
        if rel not in self.modules:
            self.modules[rel] = _Module(self.root, rel)
            self.sources[rel] = sha256_file(self.root / rel)
        return self.modules[rel]

    def _module_file(self, dotted: str) -> str | None:
        rel = dotted.replace(".", "/")
        for cand in (rel + ".py", rel + "/__init__.py"):
            if (self.root / cand).is_file():
                return cand
        return None

    def emit(self, rel: str, qualname: str, export_as: str | None = None) -> str:
        key = (rel, qualname)
        if key in self.emitted:
            return self.emitted[key]
        mod = self.module(rel)
        node = mod.lookup(qualname)
        # A kernel kept as ``Class.kernel`` is exported as ``Class_kernel``.
        name = export_as or qualname.replace(".", "_")
        self.emitted[key] = name
        self._deps(mod, node)
        seg = ast.get_source_segment(mod.source, node, padded=False)
        if isinstance(node, ast.FunctionDef):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            lines = mod.source.splitlines()[start - 1: node.end_lineno]
            indent = len(lines[0]) - len(lines[0].lstrip())
            lines = [ln[indent:] for ln in lines]
            lines = [ln for ln in lines if ln.strip() != "@staticmethod"]
            seg = "\n".join(lines)
            if name != node.name:
                seg = seg.replace(f"def {node.name}(", f"def {name}(", 1)
        self.chunks.append(f"# from {rel}\n{seg}\n")
        return name

    def _deps(self, mod: _Module, node: ast.stmt) -> None:
        local = set()
        if isinstance(node, ast.FunctionDef):
            local = {a.arg for a in node.args.args + node.args.kwonlyargs}
        for n in sorted(_used_names(node) - local - PROVIDED - BUILTINS):
            if n in mod.defs and mod.defs[n] is not node:
                self.emit(mod.rel, n)
            elif n in mod.imports:
                dotted, orig = mod.imports[n]
                if dotted == "vllm.triton_utils":
                    continue
                rel = self._module_file(dotted)
                if rel is None:
                    continue
                self.emit(rel, orig, export_as=n)


def extract_all(tree_root: Path, out: Path) -> list[Path]:
    if not tree_root.is_dir():
        raise ToolError(f"{tree_root} not found: run `make upstream` (tools/upstream.py fetch) first")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for modname, (rel, names) in UPSTREAM_KERNELS.items():
        ex = Extractor(tree_root)
        for qn in names:
            ex.emit(rel, qn)
        head = [f'"""GENERATED by tools/extract_upstream.py from vLLM {VLLM_VERSION}. Do not edit.',
                "", "Sources (path: sha256):"]
        head += [f"  {p}: {h}" for p, h in ex.sources.items()]
        head += ['"""', *HEADER_IMPORTS, "", "UPSTREAM_SOURCES = " + repr(ex.sources), ""]
        path = out / f"{modname}.py"
        text = "\n".join(head) + "\n\n" + "\n\n".join(ex.chunks)
        compile(text, str(path), "exec")  # fail here, not at import time
        path.write_text(text)
        written.append(path)
    (out / "__init__.py").write_text(f'"""Upstream vLLM {VLLM_VERSION} kernels (generated)."""\n')
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=UPSTREAM_TREE)
    ap.add_argument("--out", type=Path, default=BUILD / "upstream_kernels")
    a = ap.parse_args(argv)
    for p in extract_all(a.tree, a.out):
        print(p)
    return 0


if __name__ == "__main__":
    run_main(main)
