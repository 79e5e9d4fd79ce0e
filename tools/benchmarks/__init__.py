"""The benchmarks of ``tools/benchmark.py``: speed and memory goals as ratios measured in one run.

step       the k-pass training step: step time, throughput, activation memory (the default)
decode     generation: Soft / Fused(n) against Standard, the HF export against Llama (--decode)
optimizer  the optimizer step: NorMuon + Adam against Adam (--optimizers)
serving    an export served by vLLM: soft / standard decode, fused(n) prefill, vLLM / HF generate
           (--serving; only where vLLM is installed: requirements-serve.txt)
data       corpus preparation: preprocess_data against the raw tokenizer, peak memory (--data)
measure    what they measure with: interleaved timing rounds, saved activations, ratios, settings
report     the one report: a table of the variants, the ratios with their goals, notes

A benchmark is a module with ``FLAG`` (its command-line switch; None for the default), ``HELP``,
``DEFAULTS`` (preset, micro_batch_size, repeats, warmup), ``measure(args) -> results`` (a dict with
``settings`` and ``ratios``, written by --json) and ``format_report(results) -> str``; adding one is
writing such a module and listing it in ``BENCHMARKS``.
"""

from . import data, decode, optimizer, serving, step

BENCHMARKS = (step, decode, optimizer, serving, data)
