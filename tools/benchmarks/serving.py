"""Serving an FBT export with vLLM (``tools/benchmark.py --serving``; needs vLLM:
``pip install -r requirements-serve.txt`` or ``make serve-setup``, see docs/serving.md).

  * decode throughput of soft against standard requests, ``--micro-batch-size`` (16) concurrent
    requests of ``--prompt-length`` tokens decoding ``--new-tokens`` each (goal ≥ 0.97: the fusion
    adds two D×D products and a norm per decoded token);
  * prefill time of fused(n) against standard, 16 prompts of 256 tokens, one token generated
    (goal ≤ (n + 1) × 1.05: n more passes over the prompt);
  * output tokens per second of vLLM against the HF export's ``generate`` (one request at a time,
    ``--threads`` torch threads) for 32 requests of mixed lengths and modes (goal ≥ 5).

The export is ``--export`` or a random one of the benchmark shape (the shape flags; ``--preset
tiny``: 4 layers, hidden 256, FFN 768, head_dim 64) written to a temporary folder. One engine
(float32, eager, chunked prefill and prefix caching off, 32 sequences) serves every variant;
vLLM's CPU backend binds its own threads (one on 2 cores). Every round runs every variant once
(interleaved); ratios are medians over rounds.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import tempfile
from pathlib import Path

from .measure import Ratio, median_ratio, progress, settings, shape_overrides, time_rounds
from .report import format_report as report

FLAG = "--serving"
HELP = "measure serving with vLLM instead: soft / standard decode, fused(n) / standard prefill, vLLM / HF generate"
DEFAULTS = dict(preset="tiny", micro_batch_size=16, repeats=7, warmup=1, prompt_length=32, new_tokens=64)

# the shape with --preset tiny: the step benchmark's (head_dim 64: vLLM's CPU attention takes 32, 64, 80, …)
TINY_SHAPE = dict(num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4, num_query_groups=2,
                  kv_channels=64, seq_length=1024)
FUSED_PASSES = 2
PREFILL = (16, 256)  # prompts × tokens
MIXED = 32  # requests of the vLLM / HF comparison
MIXED_NEW = 32  # tokens each
MAX_MODEL_LEN = 512

RATIOS = [
    Ratio("serving_decode_throughput_soft_vs_standard", "vLLM decode throughput, soft / standard", "decode",
          "standard", "soft", (">=", 0.97)),
    Ratio(f"serving_prefill_time_fused{FUSED_PASSES}_vs_standard", f"vLLM prefill time, fused({FUSED_PASSES}) / standard",
          "prefill", "fused", "standard", ("<=", round((FUSED_PASSES + 1) * 1.05, 2))),
    Ratio("serving_generate_vllm_vs_hf", "output tokens/s, vLLM / HF generate (32 mixed requests)", "generate",
          "hf", "vllm", (">=", 5)),
]


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def write_random_export(args, folder: Path) -> Path:
    """A random export of the benchmark shape (``serving.synthetic``), through the export's config mapping;
    --quick keeps the benchmark shape (the tiny preset's head_dim 16 is not one vLLM's CPU attention takes)."""
    import argparse

    import torch

    from fbt_megatron.config import make_config
    from fbt_megatron.convert import mapping
    from fbt_megatron.serving.synthetic import write_export

    shape = shape_overrides(argparse.Namespace(**{**vars(args), "quick": False}), TINY_SHAPE)
    config = make_config(args.preset, **shape, params_dtype=torch.float32)
    h = mapping.hf_config(config, bos=None, eos=None, pad=None, with_tokenizer=False)
    h["max_position_embeddings"] = max(h["max_position_embeddings"], MAX_MODEL_LEN)
    return write_export(folder, seed=args.seed,
                        **{k: v for k, v in h.items() if k not in ("auto_map", "architectures", "model_type")})


def measure(args) -> dict:
    if not available():
        raise ValueError("--serving needs vLLM, which this environment lacks: pip install -r requirements-serve.txt "
                         "(or make serve-setup; docs/serving.md)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # vLLM's sampler compiles a logprob kernel with inductor
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    export = Path(args.export) if args.export else write_random_export(
        args, Path(tempfile.mkdtemp(prefix="fbt-serving-bench-")) / "export")
    print(f"starting vLLM on {export} …", file=sys.stderr, flush=True)
    llm = LLM(model=str(export), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              enable_chunked_prefill=False, enable_prefix_caching=False,  # repeated prompts would skip standard prefills
              max_num_seqs=32, max_model_len=MAX_MODEL_LEN, seed=args.seed)
    hf = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).eval()
    config = hf.config
    modes = {"standard": {"decode_mode": "standard"}, "soft": {"decode_mode": "soft"},
             "fused": {"decode_mode": "fused", "fused_prefill_passes": FUSED_PASSES}}

    def prompts(lengths, seed):
        g = torch.Generator().manual_seed(args.seed + seed)
        return [torch.randint(4, config.vocab_size, (n,), generator=g).tolist() for n in lengths]

    def vllm_generate(batch, names, max_tokens):
        params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=modes[m]) for m in names]
        return lambda: llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)

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
    steps = {
        "decode@standard": vllm_generate(concurrent, ["standard"] * len(concurrent), args.new_tokens),
        "decode@soft": vllm_generate(concurrent, ["soft"] * len(concurrent), args.new_tokens),
        "prefill@standard": vllm_generate(long, ["standard"] * len(long), 1),
        "prefill@fused": vllm_generate(long, ["fused"] * len(long), 1),
        "generate@vllm": vllm_generate(mixed, mixed_modes, MIXED_NEW),
        "generate@hf": hf_generate(mixed, mixed_modes, MIXED_NEW),
    }
    with progress((args.warmup + args.repeats) * len(steps), "serving benchmark", "call") as bar:
        time_rounds(steps, args.warmup, bar)
        times = time_rounds(steps, args.repeats, bar)
    llm.llm_engine.engine_core.shutdown()
    ratios = {r.key: r.result(median_ratio(times[f"{r.kind}@{r.numerator}"], times[f"{r.kind}@{r.denominator}"]))
              for r in RATIOS}
    tokens = {"decode": len(concurrent) * args.new_tokens, "prefill": PREFILL[0], "generate": MIXED * MIXED_NEW}
    return dict(
        settings=dict(export=str(export), hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                      vocab_size=config.vocab_size, concurrent=len(concurrent), prompt_length=args.prompt_length,
                      new_tokens=args.new_tokens, fused_prefill_passes=FUSED_PASSES,
                      **settings(args, load_before)),
        seconds={name: statistics.median(t) for name, t in times.items()},
        output_tokens={name: tokens[name.split("@")[0]] for name in times},
        ratios=ratios,
    )


def format_report(results: dict) -> str:
    s = results["settings"]
    title = (f"FBT serving benchmark (vLLM, fp32): export {s['export']} (hidden {s['hidden_size']}, {s['num_layers']} "
             f"layers, vocab {s['vocab_size']})")
    labels = {
        "decode@standard": f"decode, {s['concurrent']} × {s['new_tokens']} tokens, standard",
        "decode@soft": f"decode, {s['concurrent']} × {s['new_tokens']} tokens, soft",
        "prefill@standard": f"prefill, {PREFILL[0]} × {PREFILL[1]} tokens, standard",
        "prefill@fused": f"prefill, {PREFILL[0]} × {PREFILL[1]} tokens, fused({s['fused_prefill_passes']})",
        "generate@vllm": f"{MIXED} mixed requests × {MIXED_NEW} tokens, vLLM",
        "generate@hf": f"{MIXED} mixed requests × {MIXED_NEW} tokens, HF generate",
    }
    rows = [[label, f"{1e3 * results['seconds'][name]:,.0f}",
             f"{results['output_tokens'][name] / results['seconds'][name]:,.0f}"] for name, label in labels.items()]
    return report(results, title, [("variant", 44), ("ms", 9), ("output tokens/s", 16)], rows)
