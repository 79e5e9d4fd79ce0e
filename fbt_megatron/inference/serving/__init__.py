"""Serving Hugging Face FBT exports with vLLM: the fed-back state of every request under continuous
batching, decode modes per request, an OpenAI server and scoring in the modes.

An export folder as ``python -m fbt_megatron.convert to-hf`` writes it loads with
``vllm.LLM(model=EXPORT)`` and ``vllm serve EXPORT`` (no ``trust_remote_code``, no copy of the
weights) once this package is installed: its ``vllm.general_plugins`` entry point (``plugin``)
registers the model, the config and the tokenizer in every vLLM process.

* ``plugin``: the entry point (registrations and the hooks below, idempotent);
* ``requests``: a request's decode mode from ``SamplingParams.extra_args`` / the OpenAI API's
  ``vllm_xargs`` (``decode_mode``, ``fused_prefill_passes``, ``prompt_length``), checked when the
  request arrives (a bad one is that request's error);
* ``engine``: what the engine's configuration must satisfy (refusals in one line) and the export's
  defaults the requests fall back to;
* ``state``: the persistent per-request state buffer and the plan of one forward step (which row
  takes which state, how many passes);
* ``model``: the vLLM model (vLLM layers, the FBT fusion, the passes of a step);
* ``runner``: the two hooks in vLLM's (V1) model runner that hand the model its step's requests
  and free the slots of finished, aborted and preempted requests;
* ``prefix_cache``: block-hash keys that keep KV computed from fed-back states out of other
  requests' prefix-cache hits.

Importing this package imports neither vllm nor torch. See docs/serving.md.
"""

REQUIREMENTS = "pip install -r requirements-serve.txt (or make serve-setup; docs/serving.md)"


def require_vllm(what: str) -> None:
    """A one-line ValueError when vLLM is not installed in this environment: ``what`` needs it."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"{what} needs vLLM, which this environment lacks: {REQUIREMENTS}")
