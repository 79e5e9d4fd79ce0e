"""Benchmark the FBT k-pass step on this machine: step time, throughput and activation memory as ratios.

    python tools/benchmark.py                       # about 1.5 minutes on 2 idle cores
    python tools/benchmark.py --quick --json bench.json

One run measures, side by side (forward + backward of one microbatch, model only, no optimizer):
  * step time of the k-pass step, k = 2 and 3 against k = 1 (goal: no cost beyond the extra passes);
  * throughput of FBT at k = 1 against (a) ``FBTModel`` built with ``latent_feedback=False`` (the
    FBT machinery's own overhead), (b) megatron-core's ``GPTModel`` built from FBT's layer spec (the
    same network without FBT, through megatron-core's own model) and (c) ``GPTModel`` with its
    local layer spec of the same shape (information: this also prices the paper's backbone, whose
    layers add sandwich norms and head gates);
  * peak activation memory of k = 3 against k = 1, without and with pass-level recompute
    (``recompute_passes``: passes 1..k−1 are recomputed, the last pass's backward follows at once;
    goal ≤ 1.1, the last pass's activations plus the small inputs of the others), and the
    step-time price of that recompute (goal ≤ 1.23: two of k = 3 passes' forwards run again);
  * at k = 3 with megatron-core's full recompute, the activations left on the device when the
    layer inputs are offloaded to host memory (``offload_recompute_inputs``) against kept, and
    the step-time price of the copies (on a CPU-only machine a memory copy, not PCIe).

``--decode`` measures generation instead (fp32, batch 1, a short prompt; default shape ``fbt-1b``):
  * per-token decode time of Soft against Standard decoding with the KV cache (goal ≤ 1.01: the
    fusion adds 2·D² multiply-adds per token), ``fbt_megatron.generate`` on megatron-core;
  * prefill time of Fused(n) against Standard, n = 1, 2, 3 (goal ≤ (n + 1) × 1.02);
  * the Hugging Face export's Standard decoding speed against transformers' ``LlamaForCausalLM``
    of the same shape (goal ≥ 0.97; FBT's layers add sandwich norms, QK norms and a head gate).
A decode time per token is (time of prompt + N tokens − time of prompt + 1 token) / (N − 1), both
measured in the same round.

Times are medians over interleaved repeats; it prints the ratios with their goals (PASS/MISS) and
always exits 0 (it is a report). Bad flags: one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from fbt_megatron.cli import run_cli

# the default shape with --preset tiny: the tiny preset, big enough for meaningful CPU timings
BENCH_SHAPE = dict(num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4, num_query_groups=2,
                   kv_channels=64, seq_length=256)
SHAPE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "vocab_size", "seq_length")

# variant name → (model, passes k); the models are built from one seed, so they share weights
VARIANTS = {
    "fbt_k1": ("fbt", 1),
    "fbt_k2": ("fbt", 2),
    "fbt_k3": ("fbt", 3),
    "fbt_k3_recompute": ("fbt_recompute", 3),
    "fbt_k3_full": ("fbt_full", 3),
    "fbt_k3_full_offload": ("fbt_full_offload", 3),
    "no_feedback": ("no_feedback", 1),
    "gpt_fbt_layers": ("gpt_fbt_layers", 1),
    "gpt": ("gpt", 1),
}
DESCRIPTIONS = {
    "fbt_k1": "FBT, k=1",
    "fbt_k2": "FBT, k=2",
    "fbt_k3": "FBT, k=3",
    "fbt_k3_recompute": "FBT, k=3, recompute_passes",
    "fbt_k3_full": "FBT, k=3, full recompute",
    "fbt_k3_full_offload": "FBT, k=3, full recompute, offloaded",
    "no_feedback": "FBTModel(latent_feedback=False)",
    "gpt_fbt_layers": "megatron-core GPTModel, FBT's layers",
    "gpt": "megatron-core GPTModel, local spec",
}


@dataclass(frozen=True)
class Ratio:
    """numerator / denominator of a measurement ("time", "throughput" or "memory") with its goal:
    ``goal`` is (op, value), op one of <=, >=, ≈ (within 10 %), or None for information only."""

    key: str
    label: str
    kind: str
    numerator: str
    denominator: str
    goal: Optional[tuple] = None

    def status(self, value: float) -> str:
        if self.goal is None:
            return "info"
        op, target = self.goal
        ok = {"<=": value <= target, ">=": value >= target, "≈": abs(value / target - 1) <= 0.1}[op]
        return "PASS" if ok else "MISS"


RATIOS = [
    Ratio("step_time_k2_vs_k1", "step time, k=2 / k=1", "time", "fbt_k2", "fbt_k1", ("<=", 2.04)),
    Ratio("step_time_k3_vs_k1", "step time, k=3 / k=1", "time", "fbt_k3", "fbt_k1", ("<=", 3.06)),
    Ratio("throughput_vs_no_feedback", "throughput, FBT k=1 / FBTModel(latent_feedback=False)", "throughput",
          "fbt_k1", "no_feedback", (">=", 0.99)),
    Ratio("throughput_vs_gpt_model", "throughput, FBT k=1 / megatron-core GPTModel, FBT's layers", "throughput",
          "fbt_k1", "gpt_fbt_layers", (">=", 0.99)),
    Ratio("throughput_vs_gpt_local_spec", "throughput, FBT k=1 / megatron-core GPTModel, local spec (*)",
          "throughput", "fbt_k1", "gpt"),
    Ratio("activation_memory_k2_vs_k1", "peak activations, k=2 / k=1 (sanity check)", "memory",
          "fbt_k2", "fbt_k1", ("≈", 2.0)),
    Ratio("activation_memory_k3_vs_k1", "peak activations, k=3 / k=1", "memory", "fbt_k3", "fbt_k1"),
    Ratio("activation_memory_k3_vs_k1_recompute", "peak activations, k=3 with recompute_passes / k=1", "memory",
          "fbt_k3_recompute", "fbt_k1", ("<=", 1.1)),  # k=1 with recompute_passes is k=1: its pass is the last
    Ratio("recompute_time_k3", "step time, k=3, recompute_passes / without", "time", "fbt_k3_recompute", "fbt_k3",
          ("<=", 1.23)),
    Ratio("offload_memory_k3", "device activations, k=3 full recompute, offloaded / kept (**)", "memory",
          "fbt_k3_full_offload", "fbt_k3_full"),
    Ratio("offload_time_k3", "step time, k=3 full recompute, offloaded / kept", "time", "fbt_k3_full_offload",
          "fbt_k3_full"),
]
ARCHITECTURE_NOTE = ("(*) the paper's backbone against megatron-core's standard layer: every FBT layer adds two "
                     "sandwich RMSNorms and a headwise attention gate; the two rows above price the FBT machinery.\n"
                     "(**) offloaded tensors sit in host memory and are not counted; every layer input is offloaded here "
                     "(min_offloaded_tensor_size 0).")


# ---------------------------------------------------------------- command line
class _Parser(argparse.ArgumentParser):
    """Bad flags raise ValueError, which ``run_cli`` turns into one ``error:`` line and exit code 2."""

    def error(self, message):
        raise ValueError(message)


def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset",
                        help="model preset (default: tiny; fbt-1b with --decode); shape flags not given default to "
                             "the benchmark shape for 'tiny' (4 layers, hidden 256, FFN 768, seq 256) and to the "
                             "preset's own shape otherwise")
    parser.add_argument("--decode", action="store_true", help="measure generation instead of the training step")
    parser.add_argument("--optimizers", action="store_true",
                        help="measure the optimizer step instead: NorMuon + Adam against Adam, tiny and mid-size model")
    parser.add_argument("--prompt-length", type=int, metavar="N", default=16, help="--decode: prompt tokens (default: 16)")
    parser.add_argument("--new-tokens", type=int, metavar="N", default=9,
                        help="--decode: tokens generated in the decode measurement (default: 9, >= 2)")
    for name in SHAPE_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), type=int, metavar="N")
    parser.add_argument("--sliding-window", type=int, metavar="N", help="attention window (0: every layer global)")
    parser.add_argument("--micro-batch-size", type=int, metavar="N", help="sequences per step (default: 4)")
    parser.add_argument("--repeats", type=int, metavar="N", help="timed steps per variant (default: 21)")
    parser.add_argument("--warmup", type=int, metavar="N", help="untimed rounds first (default: 2)")
    parser.add_argument("--threads", type=int, metavar="N", default=2, help="torch intra-op threads (default: 2)")
    parser.add_argument("--seed", type=int, metavar="N", default=1234, help="weights and tokens (default: 1234)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the preset's own (tiny) shape, micro-batch 2, 1 repeat, 1 warmup round")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.preset is None:
        args.preset = "fbt-1b" if args.decode and not args.quick else "tiny"
    if args.quick:
        defaults = dict(micro_batch_size=2, repeats=1, warmup=1)
    elif args.decode:
        defaults = dict(micro_batch_size=1, repeats=5, warmup=1)
    else:
        defaults = dict(micro_batch_size=4, repeats=21, warmup=2)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2, got {args.new_tokens}")
    for name in (*SHAPE_FLAGS, "micro_batch_size", "repeats", "threads", "prompt_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("warmup", "sliding_window"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.json is not None and args.json.is_dir():
        raise ValueError(f"--json {args.json} is a directory; give a file path")
    return args


def shape_overrides(args) -> dict:
    """make_config overrides for the benchmarked shape (see --preset's help)."""
    from fbt_megatron.config import PRESETS

    if args.preset not in PRESETS:
        raise ValueError(f"unknown model preset {args.preset!r}; choose one of {sorted(PRESETS)}")
    shape = dict(BENCH_SHAPE) if args.preset == "tiny" and not (args.quick or args.decode) else {}
    shape.update({name: getattr(args, name) for name in SHAPE_FLAGS if getattr(args, name) is not None})
    full = {**PRESETS[args.preset], **shape}
    if args.hidden_size is not None and args.kv_channels is None:  # keep heads × head size = hidden
        shape["kv_channels"] = full["hidden_size"] // full["num_attention_heads"]
    if full["num_attention_heads"] % full["num_query_groups"]:
        raise ValueError(f"--num-attention-heads ({full['num_attention_heads']}) must be a multiple of "
                         f"--num-query-groups ({full['num_query_groups']})")
    if args.sliding_window is not None:
        shape["sliding_window"] = args.sliding_window or None
    return shape


# ---------------------------------------------------------------- models and steps
def build_models(args, shape: dict) -> Dict[str, torch.nn.Module]:
    """The FBT model (plain, with pass-level recompute, with full recompute with and without
    offloading), the no-feedback FBTModel and megatron-core's GPTModel with FBT's layers and with
    its local spec, all of the same shape, in training mode."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from fbt_megatron.config import make_config
    from fbt_megatron.model import FBTModel, fbt_model_spec

    def seeded(make):
        torch.manual_seed(args.seed)
        return make().train()

    def fbt(**overrides):
        return seeded(lambda: FBTModel(make_config(args.preset, **shape, **overrides)))

    gpt_config = make_config(args.preset, **shape)  # FBT-only fields are unused by GPTModel

    def gpt(layers):
        return seeded(lambda: GPTModel(
            config=gpt_config,
            transformer_layer_spec=layers,
            vocab_size=gpt_config.vocab_size,
            max_sequence_length=gpt_config.seq_length,
            share_embeddings_and_output_weights=True,
            position_embedding_type="rope",
            rotary_base=gpt_config.rotary_base,
        ))

    spec = fbt_model_spec(gpt_config)
    fbt_layers = TransformerBlockSubmodules([spec.decoder_layer] * gpt_config.num_layers, layer_norm=spec.final_layernorm)
    # without Apex/TE the local spec's RMSNorm is torch.nn.RMSNorm (megatron's WrappedTorchNorm)
    local = get_gpt_layer_local_spec(qk_layernorm=True, normalization=gpt_config.normalization)
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {"fbt": fbt(), "fbt_recompute": fbt(recompute_passes=True), "fbt_full": fbt(**full),
            "fbt_full_offload": fbt(**full, offload_recompute_inputs=True, min_offloaded_tensor_size=0),
            "no_feedback": fbt(latent_feedback=False), "gpt_fbt_layers": gpt(fbt_layers), "gpt": gpt(local)}


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s]
    seeds: List[int]

    @classmethod
    def random(cls, batch: int, seq: int, vocab: int, seed: int) -> "Batch":
        x = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
        return cls(x[:, :-1], x[:, 1:], torch.ones(batch, seq), list(range(batch)))


def make_step(model, passes: int, batch: Batch) -> Callable[[], None]:
    """One training step's model work: forward and backward, gradients reset beforehand."""
    from fbt_megatron.fbt import masked_mean, multi_pass_loss
    from fbt_megatron.model import FBTModel

    def loss():
        if isinstance(model, FBTModel):
            return multi_pass_loss(model, batch.tokens, batch.labels, batch.loss_mask, passes, batch.seeds).loss
        return masked_mean(model(batch.tokens, None, None, labels=batch.labels), batch.loss_mask)

    def step():
        model.zero_grad(set_to_none=True)
        loss().backward()

    return step


# ---------------------------------------------------------------- measurements
def time_rounds(steps: Dict[str, Callable[[], None]], rounds: int, progress) -> Dict[str, List[float]]:
    """Seconds of each step in each of `rounds` rounds. Every round runs every step once, in an
    order rotated by one each round (ABC, BCA, CAB, …), so slow drift and position effects fall
    on all of them alike. Garbage collection runs before, never during, a timed step."""
    names = list(steps)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            progress.set_postfix_str(name)
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - start)
            finally:
                gc.enable()
            progress.update()
    return times


class SavedActivations(contextlib.AbstractContextManager):
    """Peak bytes of the tensors autograd keeps for backward while the context is active.

    CPU tensors have no allocator statistics, so this watches what autograd saves: a
    ``saved_tensors_hooks`` pack hook sees every tensor saved for backward (also those saved by
    the forward that megatron's activation recompute re-runs inside backward, since the hooks
    are thread-local state that the autograd engine carries into backward). Memory is counted
    per storage, not per tensor: views and repeated saves of one storage count once (keyed by
    ``storage.data_ptr()``, sized ``storage.nbytes()``). A storage stays counted until it is
    actually freed: ``weakref.finalize`` on the storage's Python object fires when the
    underlying storage is released (PyTorch keeps that object alive as long as any tensor, the
    graph included, still uses the storage), i.e. when backward frees the saved tensors or the
    last tensor viewing it goes away. Live bytes only grow when a new storage is saved, so the
    peak is taken there. Storages in ``exclude`` (the parameters, the batch) are not activations.
    """

    def __init__(self, exclude: set):
        self.exclude = exclude
        self.live: Dict[int, int] = {}
        self.bytes = self.peak = 0
        self._finalizers: List[weakref.finalize] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or ptr in self.live or storage.nbytes() == 0:
            return tensor
        self.live[ptr] = storage.nbytes()
        self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        self._finalizers.append(weakref.finalize(storage, self._free, ptr))
        return tensor

    def _free(self, ptr: int) -> None:
        self.bytes -= self.live.pop(ptr)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for f in self._finalizers:  # storages still alive (e.g. caches) no longer report here
            f.detach()


def storage_ptrs(tensors) -> set:
    return {t.untyped_storage().data_ptr() for t in tensors}


def peak_activations(step: Callable[[], None], exclude: set) -> int:
    with SavedActivations(exclude) as saved:
        step()
    return saved.peak


# ---------------------------------------------------------------- report
def fusion_to_backbone(model) -> float:
    """The latent feedback fusion's weights over the rest (tied embedding counted once): about the
    extra matmul work of a fused pass over pass 1, which does not use the fusion."""
    params = dict(model.named_parameters())
    fusion = sum(p.numel() for name, p in params.items() if name.startswith("feedback_fusion."))
    return fusion / (sum(p.numel() for p in params.values()) - fusion)


def measure(args, shape: dict) -> dict:
    from tqdm import tqdm

    from fbt_megatron import platform

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    platform.init_distributed(seed_value=args.seed)
    models = build_models(args, shape)
    config = models["fbt"].config
    batch = Batch.random(args.micro_batch_size, config.seq_length, config.vocab_size, args.seed)
    timed = sorted({name for r in RATIOS if r.kind != "memory" for name in (r.numerator, r.denominator)},
                   key=list(VARIANTS).index)
    memory = sorted({name for r in RATIOS if r.kind == "memory" for name in (r.numerator, r.denominator)},
                    key=list(VARIANTS).index)
    steps = {name: make_step(models[VARIANTS[name][0]], VARIANTS[name][1], batch) for name in VARIANTS}

    total = (args.warmup + args.repeats) * len(timed) + len(memory)
    with tqdm(total=total, desc="benchmark", unit="step", leave=False, file=sys.stderr) as progress:
        time_rounds({n: steps[n] for n in timed}, args.warmup, progress)
        times = time_rounds({n: steps[n] for n in timed}, args.repeats, progress)
        peaks = {}
        for name in memory:
            progress.set_postfix_str(f"{name} (memory)")
            model = models[VARIANTS[name][0]]
            peaks[name] = peak_activations(steps[name], storage_ptrs([*model.parameters(), batch.tokens,
                                                                      batch.labels, batch.loss_mask]))
            progress.update()

    ratios = {}
    for r in RATIOS:
        if r.kind == "memory":
            value = peaks[r.numerator] / peaks[r.denominator]
        else:  # the median over rounds of the ratio within a round (both steps ran side by side)
            num, den = times[r.numerator], times[r.denominator]
            if r.kind == "throughput":
                num, den = den, num
            value = statistics.median(a / b for a, b in zip(num, den))
        ratios[r.key] = dict(label=r.label, value=value, goal=None if r.goal is None else f"{r.goal[0]} {r.goal[1]}",
                             status=r.status(value))
    tokens = args.micro_batch_size * config.seq_length
    step_seconds = {name: statistics.median(times[name]) for name in timed}
    return dict(
        settings=dict(preset=args.preset, **{n: getattr(config, n) for n in SHAPE_FLAGS},
                      sliding_window=config.sliding_window, full_attention_every=config.full_attention_every,
                      micro_batch_size=args.micro_batch_size, threads=args.threads, repeats=args.repeats,
                      warmup=args.warmup, seed=args.seed, cpus=os.cpu_count(),
                      load_average=[load_before, os.getloadavg()[0]]),
        fusion_to_backbone_weights=fusion_to_backbone(models["fbt"]),
        step_seconds=step_seconds,
        tokens_per_second={name: tokens / s for name, s in step_seconds.items()},
        peak_activation_bytes=peaks,
        ratios=ratios,
    )


def format_report(results: dict) -> str:
    s = results["settings"]
    lines = [
        f"FBT benchmark ({s['preset']}): {s['num_layers']} layers, hidden {s['hidden_size']}, FFN {s['ffn_hidden_size']}, "
        f"{s['num_attention_heads']} heads ({s['num_query_groups']} KV groups) × {s['kv_channels']}, "
        f"vocab {s['vocab_size']}, seq {s['seq_length']}, micro-batch {s['micro_batch_size']}; "
        f"{s['threads']} threads; medians of {s['repeats']} interleaved repeats after {s['warmup']} warm-up rounds",
        f"system load average {s['load_average'][0]:.1f} before, {s['load_average'][1]:.1f} after, on {s['cpus']} CPUs",
        "",
        f"{'variant':<36} {'step ms':>9} {'tokens/s':>10} {'peak activations MiB':>21}",
    ]
    for name in VARIANTS:
        seconds = results["step_seconds"].get(name)
        peak = results["peak_activation_bytes"].get(name)
        step_ms = "–" if seconds is None else f"{1e3 * seconds:.1f}"
        rate = "–" if seconds is None else f"{results['tokens_per_second'][name]:,.0f}"
        mib = "–" if peak is None else f"{peak / 2**20:.2f}"
        lines.append(f"{DESCRIPTIONS[name]:<36} {step_ms:>9} {rate:>10} {mib:>21}")
    lines += ["", *ratio_lines(results), "", ARCHITECTURE_NOTE]
    extra = results["fusion_to_backbone_weights"]
    lines.append(f"The fusion's 2·D² weights are {extra:.1%} of the backbone's: a fused pass does up to {extra:.1%} "
                 f"more matmul work than pass 1, so the passes alone account for k=3 / k=1 up to {3 + 2 * extra:.3f}.")
    lines += load_warning(results)
    return "\n".join(lines)


def ratio_lines(results: dict) -> List[str]:
    """The ratio table: label, measured value, goal, PASS/MISS/info."""
    width = max(len(r["label"]) for r in results["ratios"].values())
    return [f"{'ratio':<{width}} {'measured':>8}  {'goal':<8} result"] + [
        f"{r['label']:<{width}} {r['value']:>8.3f}  {r['goal'] or '–':<8} {r['status']}" for r in results["ratios"].values()
    ]


def load_warning(results: dict) -> List[str]:
    """A warning line when the last minute's load exceeds this run's own threads (noisy timings)."""
    s = results["settings"]
    if s["load_average"][1] > s["threads"] + 1:
        return ["warning: the load average shows other processes competing for the CPUs: timings are noisy"]
    return []


# ---------------------------------------------------------------- decoding (--decode)
FUSED_PREFILL = (1, 2, 3)
DECODE_RATIOS = [
    Ratio("decode_time_soft_vs_standard", "decode time per token, Soft / Standard", "decode", "soft", "standard",
          ("<=", 1.01)),
    *[Ratio(f"prefill_time_fused{n}_vs_standard", f"prefill time, Fused({n}) / Standard", "prefill",
            f"fused{n}", "standard", ("<=", round((n + 1) * 1.02, 2))) for n in FUSED_PREFILL],
    Ratio("hf_decode_speed_vs_llama", "decode speed, HF export (Standard) / transformers LlamaForCausalLM",
          "decode", "hf_llama", "hf_fbt", (">=", 0.97)),
    Ratio("hf_decode_time_vs_megatron", "decode time per token, HF export / megatron-core (Standard)", "decode",
          "hf_fbt", "standard"),
]


def decode_models(args, shape: dict) -> dict:
    """megatron-core's FBTModel (local spec, as ``runs.load_run`` builds it), its Hugging Face
    export (the same weights through ``convert.mapping``) and transformers' Llama of the same shape
    (tied embeddings, SDPA attention; random weights): all fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fbt_megatron.config import make_config
    from fbt_megatron.convert import mapping
    from fbt_megatron.convert.hf.configuration_fbt import FBTConfig as HFConfig
    from fbt_megatron.convert.hf.modeling_fbt import FBTForCausalLM
    from fbt_megatron.runs import build_inference_model

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


def decode_steps(models: dict, prompt: List[int], new_tokens: int) -> Dict[str, Dict[int, Callable[[], None]]]:
    """{variant: {tokens generated: the call}}: 1 token (the prompt's prefill) and ``new_tokens``."""
    from fbt_megatron.generate import generate

    def mcore(mode: str, n: int = 0):
        return lambda count: lambda: generate(models["mcore"], [prompt], mode=mode, fused_passes=n, max_new_tokens=count)

    def hf(name: str):
        ids = torch.tensor([prompt])
        return lambda count: lambda: models[name].generate(ids, max_new_tokens=count, min_new_tokens=count,
                                                           do_sample=False, pad_token_id=0)

    makers = {"standard": mcore("standard"), "soft": mcore("soft"),
              **{f"fused{n}": mcore("fused", n) for n in FUSED_PREFILL}, "hf_fbt": hf("hf_fbt"), "hf_llama": hf("hf_llama")}
    counts = {name: (1,) if name.startswith("fused") else (1, new_tokens) for name in makers}
    return {name: {c: makers[name](c) for c in counts[name]} for name in makers}


def measure_decode(args, shape: dict) -> dict:
    from tqdm import tqdm

    from fbt_megatron import platform

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    platform.init_distributed(seed_value=args.seed)
    print("building the models (random weights) …", file=sys.stderr, flush=True)
    models = decode_models(args, shape)
    config = models["mcore"].config
    prompt = torch.randint(0, config.vocab_size, (args.prompt_length,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    steps = decode_steps(models, prompt, args.new_tokens)
    flat = {f"{name}@{count}": call for name, calls in steps.items() for count, call in calls.items()}
    with torch.no_grad(), tqdm(total=(args.warmup + args.repeats) * len(flat), desc="decode benchmark", unit="call",
                               leave=False, file=sys.stderr) as progress:
        time_rounds(flat, args.warmup, progress)
        times = time_rounds(flat, args.repeats, progress)
    prefill = {name: times[f"{name}@1"] for name in steps}
    per_token = {name: [(full - first) / (args.new_tokens - 1) for full, first in zip(times[f"{name}@{args.new_tokens}"], prefill[name])]
                 for name, calls in steps.items() if args.new_tokens in calls}
    ratios = {}
    for r in DECODE_RATIOS:
        series = per_token if r.kind == "decode" else prefill
        value = statistics.median(a / b for a, b in zip(series[r.numerator], series[r.denominator]))
        ratios[r.key] = dict(label=r.label, value=value, goal=None if r.goal is None else f"{r.goal[0]} {r.goal[1]}",
                             status=r.status(value))
    return dict(
        settings=dict(preset=args.preset, **{n: getattr(config, n) for n in SHAPE_FLAGS},
                      sliding_window=config.sliding_window, full_attention_every=config.full_attention_every,
                      prompt_length=args.prompt_length, new_tokens=args.new_tokens, threads=args.threads,
                      repeats=args.repeats, warmup=args.warmup, seed=args.seed, cpus=os.cpu_count(),
                      parameters=sum(p.numel() for p in models["mcore"].parameters()),
                      load_average=[load_before, os.getloadavg()[0]]),
        prefill_seconds={name: statistics.median(t) for name, t in prefill.items()},
        decode_seconds_per_token={name: statistics.median(t) for name, t in per_token.items()},
        ratios=ratios,
    )


def format_decode_report(results: dict) -> str:
    s = results["settings"]
    lines = [
        f"FBT decode benchmark ({s['preset']}, {s['parameters']:,} parameters, fp32): {s['num_layers']} layers, "
        f"hidden {s['hidden_size']}, vocab {s['vocab_size']}; batch 1, a {s['prompt_length']}-token prompt, "
        f"{s['new_tokens']} tokens; {s['threads']} threads; medians of {s['repeats']} interleaved repeats",
        f"system load average {s['load_average'][0]:.1f} before, {s['load_average'][1]:.1f} after, on {s['cpus']} CPUs",
        "",
        f"{'variant':<34} {'prefill ms':>11} {'decode ms/token':>16}",
    ]
    names = {"standard": "megatron-core, Standard", "soft": "megatron-core, Soft",
             **{f"fused{n}": f"megatron-core, Fused({n})" for n in FUSED_PREFILL},
             "hf_fbt": "HF export, Standard", "hf_llama": "transformers Llama, same shape"}
    for name, label in names.items():
        decode = results["decode_seconds_per_token"].get(name)
        lines.append(f"{label:<34} {1e3 * results['prefill_seconds'][name]:>11.1f} "
                     f"{'–' if decode is None else f'{1e3 * decode:.1f}':>16}")
    lines += ["", *ratio_lines(results), *load_warning(results)]
    return "\n".join(lines)


def main(argv=None) -> int:
    for category in (UserWarning, FutureWarning, DeprecationWarning):  # megatron/torch API notices
        warnings.filterwarnings("ignore", category=category, module=r"(megatron|torch)\..*")
    args = parse_args(argv)
    if args.optimizers:
        results = measure_optimizers(args)
        print(format_optimizer_report(results))
    elif args.decode:
        results = measure_decode(args, shape_overrides(args))
        print(format_decode_report(results))
    else:
        results = measure(args, shape_overrides(args))
        print(format_report(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


# ---------------------------------------------------------------- --optimizers: the optimizer step
OPTIMIZER_SHAPES = {  # name → make_config overrides of the tiny preset
    "tiny": {},
    "mid (8 layers, hidden 512)": dict(num_layers=8, hidden_size=512, ffn_hidden_size=1536, num_attention_heads=8,
                                       num_query_groups=4, kv_channels=64),
}


def optimizer_step(optimizer_name: str, shape: dict, seed: int) -> Callable[[], None]:
    """One optimizer step of the training run's optimizer (``build.build_optimizer``, one
    process) on fixed random gradients, weights updated in place."""
    from fbt_megatron import flags
    from fbt_megatron.build import build_model, build_optimizer

    recipe = flags.parse(["--optimizer", optimizer_name, "--lr", "0.01", "--adam-lr", "5e-4",
                          *(f"--{k.replace('_', '-')}={v}" for k, v in shape.items())], prog="benchmark", description="")
    config, model, ddp = build_model(recipe, 2048)
    optimizer, _ = build_optimizer(recipe, config, ddp)
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=generator))
    return optimizer.step


def measure_optimizers(args) -> dict:
    """Median optimizer step time (s) of NorMuon + Adam and of Adam per shape, interleaved repeats."""
    from tqdm import tqdm

    from fbt_megatron import platform

    torch.set_num_threads(args.threads)
    platform.init_distributed(seed_value=args.seed)
    results = {}
    for name, shape in OPTIMIZER_SHAPES.items():
        steps = {opt: optimizer_step(opt, shape, args.seed) for opt in ("normuon", "adam")}
        with tqdm(total=(args.warmup + args.repeats) * len(steps), desc=name, disable=not sys.stderr.isatty()) as progress:
            time_rounds(steps, args.warmup, progress)
            times = time_rounds(steps, args.repeats, progress)
        results[name] = {opt: statistics.median(t) for opt, t in times.items()}
    return results


def format_optimizer_report(results: dict) -> str:
    lines = [f"{'model':<28}{'NorMuon+Adam ms':>17}{'Adam ms':>10}{'ratio':>8}"]
    for name, t in results.items():
        lines.append(f"{name:<28}{1e3 * t['normuon']:>17.1f}{1e3 * t['adam']:>10.1f}{t['normuon'] / t['adam']:>8.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    run_cli(main)
