"""Prefix caching with fed-back states: KV computed from them is never another request's hit.

vLLM hashes every full KV block of a request (prompt and generated tokens) and lets later requests
with the same token prefix reuse it. Keys and values depend on the fed-back state where a position
took a fused input: a soft/fused request's decoded positions, and every prompt position of a
fused(n) request (the (n+1)-th pass). Those blocks get an extra hash key naming the request
(``generate_block_hash_extra_keys``, vLLM's per-block keys for LoRA, multi-modal inputs and
``cache_salt``), so no other request can match them; soft/fused requests also never read the prefix
cache (``SamplingParams.skip_reading_prefix_cache``, set at admission), so a preempted request
recomputes all of its states. Plain blocks (standard requests, a soft request's prompt) are shared
as usual. Installed once per process by the plugin (the engine core hashes).
"""

from __future__ import annotations

import functools


def private_key(request, end_token_idx: int):
    """The extra key of a block ending at ``end_token_idx`` of ``request``, or None (plain KV)."""
    params = getattr(request, "sampling_params", None)
    args = (params.extra_args or {}) if params is not None else {}
    mode = args.get("decode_mode", "standard")
    if mode == "standard":
        return None
    prompt = min(args.get("prompt_length") or request.num_prompt_tokens, request.num_prompt_tokens)
    if mode == "fused" or end_token_idx > prompt:
        return ("fbt-fed-back", request.request_id)
    return None


def install() -> None:
    from vllm.v1.core import kv_cache_utils

    original = kv_cache_utils.generate_block_hash_extra_keys
    if getattr(original, "_fbt", False):
        return

    @functools.wraps(original)
    def extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        keys, next_mm = original(request, start_token_idx, end_token_idx, start_mm_idx)
        key = private_key(request, end_token_idx)
        if key is not None:
            keys = (*(keys or ()), key)
        return keys, next_mm

    extra_keys._fbt = True
    kv_cache_utils.generate_block_hash_extra_keys = extra_keys
