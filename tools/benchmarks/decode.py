"""Generation (``tools/benchmark.py --decode``): fp32, batch 1, a short prompt; default shape ``fbt-1b``.

  * per-token decode time of Soft against Standard decoding with the KV cache (goal ≤ 1.01: the
    fusion adds 2·D² multiply-adds per token), ``fbt_megatron.generate`` on megatron-core;
  * prefill time of Fused(n) against Standard, n = 1, 2, 3 (goal ≤ (n + 1) × 1.02);
  * the Hugging Face export's Standard decoding speed against transformers' ``LlamaForCausalLM``
    of the same shape (goal ≥ 0.97; FBT's layers add sandwich norms, QK norms and a head gate).
A decode time per token is measured inside one generation of N tokens: (time the N-th token was
chosen − time the first was) / (N − 1), from timestamps the generation hands out as it goes
(``generate``'s ``on_token``, transformers' streamer); a prefill time is a generation of 1 token.
No time is the difference of two separately timed runs, so none is negative on a busy machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

from .measure import Ratio, Seconds, median_ratio, progress, settings, shape_overrides, start, time_rounds
from .report import format_report as report

FLAG = "--decode"
HELP = "measure generation instead of the training step"
DEFAULTS = dict(preset="fbt-1b", micro_batch_size=1, repeats=5, warmup=1, prompt_length=16, new_tokens=9)

FUSED_PREFILL = (1, 2, 3)
RATIOS = [
    Ratio("decode_time_soft_vs_standard", "decode time per token, Soft / Standard", "decode", "soft", "standard",
          ("<=", 1.01)),
    *[Ratio(f"prefill_time_fused{n}_vs_standard", f"prefill time, Fused({n}) / Standard", "prefill",
            f"fused{n}", "standard", ("<=", round((n + 1) * 1.02, 2))) for n in FUSED_PREFILL],
    Ratio("hf_decode_speed_vs_llama", "decode speed, HF export (Standard) / transformers LlamaForCausalLM",
          "decode", "hf_llama", "hf_fbt", (">=", 0.97)),
    Ratio("hf_decode_time_vs_megatron", "decode time per token, HF export / megatron-core (Standard)", "decode",
          "hf_fbt", "standard"),
]


def build_models(args, shape: dict) -> dict:
    """megatron-core's FBTModel (local spec, as ``runs.load_run`` builds it), its Hugging Face
    export (the same weights through ``convert.mapping``) and transformers' Llama of the same shape
    (tied embeddings, SDPA attention; random weights): all fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fbt_megatron.inference.convert import mapping
    from fbt_megatron.inference.convert.hf.configuration_fbt import FBTConfig as HFConfig
    from fbt_megatron.inference.convert.hf.modeling_fbt import FBTForCausalLM
    from fbt_megatron.inference.runs import build_inference_model
    from fbt_megatron.model.config import make_config

    torch.manual_seed(args.seed)
    config = make_config(args.preset, **shape, params_dtype=torch.float32)
    mcore = build_inference_model(config)
    h = mapping.hf_config(config, bos=None, eos=None, pad=None, with_tokenizer=False)
    hf = FBTForCausalLM(HFConfig(**{k: v for k, v in h.items() if k not in ("auto_map", "architectures", "model_type")}))
    hf.load_state_dict(mapping.to_hf(mcore.state_dict(), mapping.Shape.of_config(config)), strict=False)
    llama = LlamaForCausalLM(LlamaConfig(
        hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
        head_dim=config.kv_channels, vocab_size=config.vocab_size, max_position_embeddings=config.seq_length,
        rms_norm_eps=config.layernorm_epsilon, rope_theta=config.rotary_base, tie_word_embeddings=True,
        attn_implementation="sdpa"))
    return {"mcore": mcore, "hf_fbt": hf.eval(), "hf_llama": llama.eval()}


class TokenClock:
    """The times at which a generation hands out its tokens: a callable for ``generate``'s
    ``on_token`` and a transformers streamer (whose first ``put`` is the prompt, not a token)."""

    def __init__(self, streamer: bool = False):
        self.times: List[float] = []
        self.skip = int(streamer)

    def __call__(self, *_):
        self.times.append(time.perf_counter())

    def put(self, _tokens):
        if self.skip:
            self.skip -= 1
        else:
            self()

    def end(self):
        pass

    def per_token(self) -> Seconds:
        """Seconds per token after the first (the first comes out of the prefill)."""
        return Seconds((self.times[-1] - self.times[0]) / (len(self.times) - 1))


def make_steps(models: dict, prompt: List[int], new_tokens: int) -> Dict[str, Dict[int, Callable[[], None]]]:
    """{variant: {tokens generated: the call}}: 1 token (the prompt's prefill, timed whole) and
    ``new_tokens`` (returns its own per-token decode time)."""
    from fbt_megatron.inference.generate import generate

    def mcore(mode: str, n: int = 0):
        def call(count: int):
            def step():
                clock = TokenClock()
                generate(models["mcore"], [prompt], mode=mode, fused_passes=n, max_new_tokens=count, on_token=clock)
                return clock.per_token() if count > 1 else None
            return step
        return call

    def hf(name: str):
        ids = torch.tensor([prompt])

        def call(count: int):
            def step():
                clock = TokenClock(streamer=True)
                models[name].generate(ids, max_new_tokens=count, min_new_tokens=count, do_sample=False,
                                      pad_token_id=0, streamer=clock)
                return clock.per_token() if count > 1 else None
            return step
        return call

    makers = {"standard": mcore("standard"), "soft": mcore("soft"),
              **{f"fused{n}": mcore("fused", n) for n in FUSED_PREFILL}, "hf_fbt": hf("hf_fbt"), "hf_llama": hf("hf_llama")}
    counts = {name: (1,) if name.startswith("fused") else (1, new_tokens) for name in makers}
    return {name: {c: makers[name](c) for c in counts[name]} for name in makers}


def measure(args) -> dict:
    shape = shape_overrides(args, {})
    load_before = start(args)
    print("building the models (random weights) …", file=sys.stderr, flush=True)
    models = build_models(args, shape)
    config = models["mcore"].config
    prompt = torch.randint(0, config.vocab_size, (args.prompt_length,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    steps = make_steps(models, prompt, args.new_tokens)
    flat = {f"{name}@{count}": call for name, calls in steps.items() for count, call in calls.items()}
    with torch.no_grad(), progress((args.warmup + args.repeats) * len(flat), "decode benchmark", "call") as bar:
        time_rounds(flat, args.warmup, bar)
        times = time_rounds(flat, args.repeats, bar)
    prefill = {name: times[f"{name}@1"] for name in steps}
    per_token = {name: times[f"{name}@{args.new_tokens}"] for name, calls in steps.items() if args.new_tokens in calls}
    ratios = {}
    for r in RATIOS:
        series = per_token if r.kind == "decode" else prefill
        ratios[r.key] = r.result(median_ratio(series[r.numerator], series[r.denominator]))
    return dict(
        settings=settings(args, load_before, config, prompt_length=args.prompt_length, new_tokens=args.new_tokens,
                          parameters=sum(p.numel() for p in models["mcore"].parameters())),
        prefill_seconds={name: statistics.median(t) for name, t in prefill.items()},
        decode_seconds_per_token={name: statistics.median(t) for name, t in per_token.items()},
        ratios=ratios,
    )


def format_report(results: dict) -> str:
    s = results["settings"]
    title = (f"FBT decode benchmark ({s['parameters']:,} parameters, fp32): batch 1, a {s['prompt_length']}-token "
             f"prompt, {s['new_tokens']} tokens")
    names = {"standard": "megatron-core, Standard", "soft": "megatron-core, Soft",
             **{f"fused{n}": f"megatron-core, Fused({n})" for n in FUSED_PREFILL},
             "hf_fbt": "HF export, Standard", "hf_llama": "transformers Llama, same shape"}
    rows = []
    for name, label in names.items():
        decode = results["decode_seconds_per_token"].get(name)
        rows.append([label, f"{1e3 * results['prefill_seconds'][name]:.1f}", "–" if decode is None else f"{1e3 * decode:.1f}"])
    return report(results, title, [("variant", 34), ("prefill ms", 11), ("decode ms/token", 16)], rows)
