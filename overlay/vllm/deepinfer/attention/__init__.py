"""The Ampere (SM80/SM86, also SM89) attention path of DeepSeek-V4.1 and V4.

Unlike the rest of ``vllm.deepinfer`` these modules import vLLM 0.33.0 itself: they are
used from inside the patched model modules, never imported by ``vllm.deepinfer``'s own
``__init__``, so ``import vllm.deepinfer`` still needs only torch and triton.

    selector      which attention class a DeepSeek-V4.1/V4 decoder layer gets on CUDA
                  (patches 0004/0005 call it from both ``_select_dsv4_attn_cls``)
    ampere_v41    DeepinferAmpereV41Attention (+ its backends, SWA metadata builder, indexer)
    ampere_v4     DeepinferAmpereV4Attention (the V4 twin)
    common        what the two share: decode/prefill/o_proj bodies, the DeepGEMM-free
                  indexer op, the SWA metadata builder that never plans FlashMLA tiles

docs/ampere-path.md describes the request path, what is implemented and what still raises
``NotImplementedError``.
"""
