"""Serving an FBT export with vLLM (``tools/benchmark.py --serving``; needs vLLM:
``pip install -r requirements-serve.txt`` or ``make serve-setup``, see docs/serving.md).

  * decode throughput against vLLM's native Qwen3 of the same shape (hidden, layers, heads, head
    dimension, FFN, vocabulary; random weights written locally, no download), ``--micro-batch-size``
    (16) concurrent requests of ``--prompt-length`` (32) tokens decoding ``--new-tokens`` (64) each, with
    vLLM's default compilation and with ``enforce_eager``: FBT standard (goal ≥ 0.95) and soft
    (goal ≥ 0.92) output tokens/s over Qwen3's;
  * for information, the same for two variants of the FBT export: every layer global (FBT's layer
    without sliding windows: what two KV-cache groups cost in vLLM's scheduler and attention
    metadata), standard; and Qwen3's layer (no headwise gate, no sandwich norms, every layer global;
    the fusion, its state and the plugin kept): what the plugin costs, apart from FBT's layer; and
    against vLLM's native Gemma3 of the same shape and FBT's attention layout (q/k norms, sandwich
    norms, the same sliding-window layers; GeGLU, no headwise gate, no fusion): what FBT costs over
    a native model that pays for the same windows and norms, and what those cost Gemma3 over Qwen3;
  * decode throughput of soft against standard requests (goal ≥ 0.97: the fusion adds two D×D
    products and a norm per decoded token);
  * prefill time of fused(n) against standard, 16 prompts of 256 tokens, one token generated
    (goal ≤ (n + 1) × 1.05: n more passes over the prompt);
  * output tokens per second of vLLM (compiled) against the HF export's ``generate`` (one request
    at a time, ``--threads`` torch threads) for 32 requests of mixed lengths and modes (goal ≥ 5).

The export is ``--export`` or a random one of the benchmark shape (the shape flags; ``--preset
tiny``: 4 layers, hidden 256, FFN 768, head_dim 64) written to a temporary folder. Every engine has
the same settings (float32, chunked prefill and prefix caching off, 32 sequences, a 256 MiB KV
cache). The engines of one compilation live in one host process (``_host``, spawned), in that
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor): a call is the engine's own
work, with no engine-core or worker process of another engine spinning beside it (a vLLM worker
busy-waits 1 s after its last message, and on 2 cores every engine's worker is bound to the same
core) and no inter-process hops, which are the same for every model and only dilute the differences
measured. HF ``generate`` runs in the benchmark's own process. Every round runs every variant once
in a rotated order (interleaved); ratios are medians over rounds of the ratios within a round: many
short calls (about 0.2 s) instead of a few long ones, because this machine's speed moves by ±15%
from one second to the next.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .measure import Ratio, Seconds, median_ratio, progress, settings, shape_overrides, time_rounds
from .report import format_report as report

FLAG = "--serving"
HELP = ("measure serving with vLLM instead: FBT / vLLM's Qwen3 decode (compiled, eager), soft / standard decode, "
        "fused(n) / standard prefill, vLLM / HF generate")
DEFAULTS = dict(preset="tiny", micro_batch_size=16, repeats=30, warmup=2, prompt_length=32, new_tokens=64)

# the shape with --preset tiny: the step benchmark's (head_dim 64: vLLM's CPU attention takes 32, 64, 80, …)
TINY_SHAPE = dict(num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4, num_query_groups=2,
                  kv_channels=64, seq_length=1024)
# FBT's layer with every layer global: what sliding windows cost (two KV-cache groups in vLLM)
GLOBAL_LAYERS = dict(sliding_window=None, layer_types=None)
# FBT with Qwen3's layer: what the plugin costs, apart from the layer's own extra work
QWEN3_LAYER = dict(attention_gate=False, sandwich_norm=False, **GLOBAL_LAYERS)
FUSED_PASSES = 2
PREFILL = (16, 256)  # prompts × tokens
MIXED = 32  # requests of the vLLM / HF comparison
MIXED_NEW = 32  # tokens each
MAX_MODEL_LEN = 512
KV_CACHE_BYTES = 256 << 20  # per engine: 16 × 96 tokens need ~6 MiB at the benchmark shape
COMPILATIONS = ("compiled", "eager")  # vLLM's default, enforce_eager
MODES = {"standard": {"decode_mode": "standard"}, "soft": {"decode_mode": "soft"},
         "fused": {"decode_mode": "fused", "fused_prefill_passes": FUSED_PASSES}}

RATIOS = [
    *(Ratio(f"serving_decode_{mode}_vs_qwen3_{c}", f"decode output tokens/s, FBT {mode} / vLLM's Qwen3 ({c})",
            f"decode-{c}", "qwen3", mode, (">=", goal)) for c in COMPILATIONS for mode, goal in (("standard", 0.95),
                                                                                                  ("soft", 0.92))),
    *(Ratio(f"serving_decode_global_standard_vs_qwen3_{c}",
            f"decode output tokens/s, FBT with every layer global, standard / Qwen3 ({c})", f"decode-{c}", "qwen3",
            "global_standard") for c in COMPILATIONS),
    *(Ratio(f"serving_decode_{mode}_vs_gemma3_{c}",
            f"decode output tokens/s, FBT {mode} / vLLM's Gemma3, FBT's attention layout ({c})", f"decode-{c}",
            "gemma3", mode) for c in COMPILATIONS for mode in ("standard", "soft")),
    *(Ratio(f"serving_decode_gemma3_vs_qwen3_{c}", f"decode output tokens/s, vLLM's Gemma3 / Qwen3 ({c})",
            f"decode-{c}", "qwen3", "gemma3") for c in COMPILATIONS),
    *(Ratio(f"serving_decode_qwen3_layer_{mode}_vs_qwen3_{c}",
            f"decode output tokens/s, FBT with Qwen3's layer, {mode} / Qwen3 ({c})", f"decode-{c}", "qwen3",
            f"qwen3_layer_{mode}") for c in COMPILATIONS for mode in ("standard", "soft")),
    *(Ratio(f"serving_decode_throughput_soft_vs_standard_{c}", f"vLLM decode throughput, soft / standard ({c})",
            f"decode-{c}", "standard", "soft", (">=", 0.97)) for c in COMPILATIONS),
    *(Ratio(f"serving_prefill_time_fused{FUSED_PASSES}_vs_standard_{c}",
            f"vLLM prefill time, fused({FUSED_PASSES}) / standard ({c})", f"prefill-{c}", "fused", "standard",
            ("<=", round((FUSED_PASSES + 1) * 1.05, 2))) for c in COMPILATIONS),
    Ratio("serving_generate_vllm_vs_hf", "output tokens/s, vLLM (compiled) / HF generate (32 mixed requests)",
          "generate", "hf", "vllm", (">=", 5)),
]


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def write_random_export(args, folder: Path, **layer) -> Path:
    """A random export of the benchmark shape (``serving.synthetic``), through the export's config mapping,
    with ``layer``'s config.json overrides; --quick keeps the benchmark shape (the tiny preset's head_dim 16
    is not one vLLM's CPU attention takes)."""
    import argparse

    import torch

    from fbt_megatron.inference.convert import mapping
    from fbt_megatron.inference.serving.synthetic import write_export
    from fbt_megatron.model.config import make_config

    shape = shape_overrides(argparse.Namespace(**{**vars(args), "quick": False}), TINY_SHAPE)
    config = make_config(args.preset, **shape, params_dtype=torch.float32)
    h = mapping.hf_config(config, bos=None, eos=None, pad=None, with_tokenizer=False)
    h["max_position_embeddings"] = max(h["max_position_embeddings"], MAX_MODEL_LEN)
    h.update(layer)
    return write_export(folder, seed=args.seed,
                        **{k: v for k, v in h.items() if k not in ("auto_map", "architectures", "model_type")})


def write_qwen3(fbt_config, folder: Path, seed: int) -> Path:
    """vLLM's native model of the FBT export's shape: a random Qwen3 (q/k RMSNorm, GQA, SwiGLU, tied
    embeddings; global attention, no headwise gate, no sandwich norms, no fusion), saved locally."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    c = fbt_config
    config = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                         max_position_embeddings=max(c.max_position_embeddings, MAX_MODEL_LEN),
                         rope_theta=float(c.rope_theta), tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(folder)
    return folder


def write_gemma3(fbt_config, folder: Path, seed: int) -> Path:
    """vLLM's native model of the FBT export's shape and attention layout: a random Gemma3 (q/k
    RMSNorm, sandwich norms, GQA, the export's sliding-window layers, tied embeddings; GeGLU, no
    headwise gate, no fusion), saved locally."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    c = fbt_config
    layers = c.layer_types or ["full_attention"] * c.num_hidden_layers
    config = Gemma3TextConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                              num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                              num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                              query_pre_attn_scalar=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                              sliding_window=c.sliding_window or MAX_MODEL_LEN, layer_types=layers,
                              max_position_embeddings=max(c.max_position_embeddings, MAX_MODEL_LEN),
                              final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
                              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config.architectures = ["Gemma3ForCausalLM"]
    Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(folder)
    return folder


def measure(args) -> dict:
    """The exports and engines in a temporary folder, removed at the end."""
    with tempfile.TemporaryDirectory(prefix="fbt-serving-bench-", ignore_cleanup_errors=True) as folder:
        return _measure(args, Path(folder))


def _host(connection, models: dict, compilation: str, seed: int) -> None:
    """The engines of one compilation, in this (spawned) process: each request from ``connection``
    is (model, prompts, modes, max_tokens), answered with the seconds its ``generate`` took."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.dup2(2, 1)  # vLLM logs to stdout: keep the report (the parent's stdout) clean
    from vllm import LLM, SamplingParams

    engines = {}
    for name, model in models.items():
        print(f"starting vLLM ({compilation}, in-process) on {model} …", file=sys.stderr, flush=True)
        engines[name] = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32",
                            enforce_eager=compilation == "eager", distributed_executor_backend="uni",
                            enable_chunked_prefill=False, enable_prefix_caching=False,  # repeated prompts would skip prefills
                            max_num_seqs=32, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_CACHE_BYTES, seed=seed)
    connection.send("ready")
    while (request := connection.recv()) is not None:
        name, batch, modes, max_tokens = request
        params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                 extra_args=MODES[m] if m else None) for m in modes]
        start = time.perf_counter()
        engines[name].generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        connection.send(time.perf_counter() - start)


class EngineHost:
    """A ``_host`` process; ``step(...)`` is a step of ``time_rounds`` that runs one call there and
    returns the host's own timing."""

    def __init__(self, models: dict, compilation: str, seed: int):
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_host, args=(child, models, compilation, seed), daemon=True)
        self.compilation = compilation
        self.process.start()
        child.close()
        if self._receive() != "ready":
            raise RuntimeError(f"the {compilation} vLLM engines sent no 'ready'")

    def _receive(self):
        try:
            return self.connection.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the process of the {self.compilation} vLLM engines exited (exit code "
                               f"{self.process.exitcode}; its messages are above)") from None

    def step(self, model: str, batch: list, modes: list, max_tokens: int):
        def run():
            self.connection.send((model, batch, modes, max_tokens))
            return Seconds(self._receive())
        return run

    def close(self) -> None:
        if self.process.is_alive():
            self.connection.send(None)
        self.process.join()


def _measure(args, folder: Path) -> dict:
    if not available():
        raise ValueError("--serving needs vLLM, which this environment lacks: pip install -r requirements-serve.txt "
                         "(or make serve-setup; docs/serving.md)")
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    export = Path(args.export) if args.export else write_random_export(args, folder / "export")
    hf = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).eval()
    config = hf.config
    models = {"fbt": export, "qwen3": write_qwen3(config, folder / "qwen3", args.seed),
              "gemma3": write_gemma3(config, folder / "gemma3", args.seed),
              "global": write_random_export(args, folder / "global", **GLOBAL_LAYERS),
              "qwen3_layer": write_random_export(args, folder / "qwen3_layer", **QWEN3_LAYER)}

    def prompts(lengths, seed):
        g = torch.Generator().manual_seed(args.seed + seed)
        return [torch.randint(4, config.vocab_size, (n,), generator=g).tolist() for n in lengths]

    def hf_generate(batch, names, max_tokens):
        def run():
            with torch.no_grad():
                for p, m in zip(batch, names):
                    hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0, decode_mode=m,
                                fused_prefill_passes=FUSED_PASSES if m == "fused" else None)
        return run

    concurrent = prompts([args.prompt_length] * args.micro_batch_size, 1)
    long = prompts([PREFILL[1]] * PREFILL[0], 2)
    mixed = prompts([8 + (37 * i) % 120 for i in range(MIXED)], 3)
    mixed_modes = [("standard", "soft", "fused")[i % 3] for i in range(MIXED)]
    n = len(concurrent)
    times = {}
    for c in COMPILATIONS:
        host = EngineHost(models, c, args.seed)
        try:
            steps = {
                f"decode-{c}@standard": host.step("fbt", concurrent, ["standard"] * n, args.new_tokens),
                f"decode-{c}@soft": host.step("fbt", concurrent, ["soft"] * n, args.new_tokens),
                f"decode-{c}@qwen3": host.step("qwen3", concurrent, [None] * n, args.new_tokens),
                f"decode-{c}@gemma3": host.step("gemma3", concurrent, [None] * n, args.new_tokens),
                f"decode-{c}@global_standard": host.step("global", concurrent, ["standard"] * n, args.new_tokens),
                f"decode-{c}@qwen3_layer_standard": host.step("qwen3_layer", concurrent, ["standard"] * n, args.new_tokens),
                f"decode-{c}@qwen3_layer_soft": host.step("qwen3_layer", concurrent, ["soft"] * n, args.new_tokens),
                f"prefill-{c}@standard": host.step("fbt", long, ["standard"] * len(long), 1),
                f"prefill-{c}@fused": host.step("fbt", long, ["fused"] * len(long), 1),
            }
            if c == "compiled":
                steps["generate@vllm"] = host.step("fbt", mixed, mixed_modes, MIXED_NEW)
                steps["generate@hf"] = hf_generate(mixed, mixed_modes, MIXED_NEW)
            with progress((args.warmup + args.repeats) * len(steps), f"serving benchmark ({c})", "call") as bar:
                time_rounds(steps, args.warmup, bar)
                times.update(time_rounds(steps, args.repeats, bar))
        finally:
            host.close()
    ratios = {r.key: r.result(median_ratio(times[f"{r.kind}@{r.numerator}"], times[f"{r.kind}@{r.denominator}"]))
              for r in RATIOS}
    tokens = {"decode": n * args.new_tokens, "prefill": PREFILL[0], "generate": MIXED * MIXED_NEW}
    return dict(
        settings=dict(export=str(export), hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                      vocab_size=config.vocab_size, concurrent=n, prompt_length=args.prompt_length,
                      new_tokens=args.new_tokens, fused_prefill_passes=FUSED_PASSES,
                      **settings(args, load_before)),
        seconds={name: statistics.median(t) for name, t in times.items()},
        output_tokens={name: tokens[name.split("@")[0].split("-")[0]] for name in times},
        ratios=ratios,
    )


def format_report(results: dict) -> str:
    s = results["settings"]
    title = (f"FBT serving benchmark (vLLM, fp32): export {s['export']} (hidden {s['hidden_size']}, {s['num_layers']} "
             f"layers, vocab {s['vocab_size']})")
    decode = f"decode, {s['concurrent']} × {s['new_tokens']} tokens"
    labels = {}
    for c in COMPILATIONS:
        labels.update({
            f"decode-{c}@qwen3": f"{decode}, vLLM's Qwen3 ({c})",
            f"decode-{c}@standard": f"{decode}, FBT standard ({c})",
            f"decode-{c}@soft": f"{decode}, FBT soft ({c})",
            f"decode-{c}@gemma3": f"{decode}, vLLM's Gemma3, FBT's attention layout ({c})",
            f"decode-{c}@global_standard": f"{decode}, FBT, every layer global, standard ({c})",
            f"decode-{c}@qwen3_layer_standard": f"{decode}, FBT with Qwen3's layer, standard ({c})",
            f"decode-{c}@qwen3_layer_soft": f"{decode}, FBT with Qwen3's layer, soft ({c})",
            f"prefill-{c}@standard": f"prefill, {PREFILL[0]} × {PREFILL[1]} tokens, standard ({c})",
            f"prefill-{c}@fused": f"prefill, {PREFILL[0]} × {PREFILL[1]} tokens, fused({s['fused_prefill_passes']}) ({c})",
        })
    labels["generate@vllm"] = f"{MIXED} mixed requests × {MIXED_NEW} tokens, vLLM (compiled)"
    labels["generate@hf"] = f"{MIXED} mixed requests × {MIXED_NEW} tokens, HF generate"
    rows = [[label, f"{1e3 * results['seconds'][name]:,.0f}",
             f"{results['output_tokens'][name] / results['seconds'][name]:,.0f}"] for name, label in labels.items()]
    return report(results, title, [("variant", 70), ("ms", 9), ("output tokens/s", 16)], rows)
