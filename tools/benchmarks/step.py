"""The k-pass training step: step time, throughput and activation memory as ratios (the default
benchmark of ``tools/benchmark.py``).

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
"""

from __future__ import annotations

import statistics
from typing import Callable, Dict

import torch

from .measure import (Batch, Ratio, median_ratio, peak_activations, progress, settings, shape_overrides, start, storage_ptrs,
                      time_rounds)
from .report import format_report as report

FLAG = None  # the default benchmark
HELP = "the k-pass training step (the default)"
DEFAULTS = dict(preset="tiny", micro_batch_size=4, repeats=21, warmup=2)
# the shape with --preset tiny: the tiny preset, big enough for meaningful CPU timings
TINY_SHAPE = dict(num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4, num_query_groups=2,
                  kv_channels=64, seq_length=256)

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


# ---------------------------------------------------------------- models and steps
def build_models(args, shape: dict) -> Dict[str, torch.nn.Module]:
    """The FBT model (plain, with pass-level recompute, with full recompute with and without
    offloading), the no-feedback FBTModel and megatron-core's GPTModel with FBT's layers and with
    its local spec, all of the same shape, in training mode."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from fbt_megatron.model.config import make_config
    from fbt_megatron.model.fbt_model import FBTModel, fbt_model_spec

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


def make_step(model, passes: int, batch: Batch) -> Callable[[], None]:
    """One training step's model work: forward and backward, gradients reset beforehand."""
    from fbt_megatron.model.fbt import masked_mean, multi_pass_loss
    from fbt_megatron.model.fbt_model import FBTModel

    def loss():
        if isinstance(model, FBTModel):
            return multi_pass_loss(model, batch.tokens, batch.labels, batch.loss_mask, passes, batch.seeds).loss
        return masked_mean(model(batch.tokens, None, None, labels=batch.labels), batch.loss_mask)

    def step():
        model.zero_grad(set_to_none=True)
        loss().backward()

    return step


# ---------------------------------------------------------------- measurement and report
def fusion_to_backbone(model) -> float:
    """The latent feedback fusion's weights over the rest (tied embedding counted once): about the
    extra matmul work of a fused pass over pass 1, which does not use the fusion."""
    params = dict(model.named_parameters())
    fusion = sum(p.numel() for name, p in params.items() if name.startswith("feedback_fusion."))
    return fusion / (sum(p.numel() for p in params.values()) - fusion)


def measure(args) -> dict:
    shape = shape_overrides(args, TINY_SHAPE)
    load_before = start(args)
    models = build_models(args, shape)
    config = models["fbt"].config
    batch = Batch.random(args.micro_batch_size, config.seq_length, config.vocab_size, args.seed)
    timed = sorted({name for r in RATIOS if r.kind != "memory" for name in (r.numerator, r.denominator)},
                   key=list(VARIANTS).index)
    memory = sorted({name for r in RATIOS if r.kind == "memory" for name in (r.numerator, r.denominator)},
                    key=list(VARIANTS).index)
    steps = {name: make_step(models[VARIANTS[name][0]], VARIANTS[name][1], batch) for name in VARIANTS}

    with progress((args.warmup + args.repeats) * len(timed) + len(memory), "benchmark", "step") as bar:
        time_rounds({n: steps[n] for n in timed}, args.warmup, bar)
        times = time_rounds({n: steps[n] for n in timed}, args.repeats, bar)
        peaks = {}
        for name in memory:
            bar.set_postfix_str(f"{name} (memory)")
            model = models[VARIANTS[name][0]]
            peaks[name] = peak_activations(steps[name], storage_ptrs([*model.parameters(), batch.tokens,
                                                                      batch.labels, batch.loss_mask]))
            bar.update()

    ratios = {}
    for r in RATIOS:
        if r.kind == "memory":
            value = peaks[r.numerator] / peaks[r.denominator]
        elif r.kind == "throughput":
            value = median_ratio(times[r.denominator], times[r.numerator])
        else:
            value = median_ratio(times[r.numerator], times[r.denominator])
        ratios[r.key] = r.result(value)
    tokens = args.micro_batch_size * config.seq_length
    step_seconds = {name: statistics.median(times[name]) for name in timed}
    return dict(
        settings=settings(args, load_before, config, micro_batch_size=args.micro_batch_size),
        fusion_to_backbone_weights=fusion_to_backbone(models["fbt"]),
        step_seconds=step_seconds,
        tokens_per_second={name: tokens / s for name, s in step_seconds.items()},
        peak_activation_bytes=peaks,
        ratios=ratios,
    )


def format_report(results: dict) -> str:
    title = f"FBT benchmark: the k-pass training step, micro-batch {results['settings']['micro_batch_size']}"
    rows = []
    for name in VARIANTS:
        seconds = results["step_seconds"].get(name)
        peak = results["peak_activation_bytes"].get(name)
        rows.append([DESCRIPTIONS[name], "–" if seconds is None else f"{1e3 * seconds:.1f}",
                     "–" if seconds is None else f"{results['tokens_per_second'][name]:,.0f}",
                     "–" if peak is None else f"{peak / 2**20:.2f}"])
    extra = results["fusion_to_backbone_weights"]
    fusion = (f"The fusion's 2·D² weights are {extra:.1%} of the backbone's: a fused pass does up to {extra:.1%} "
              f"more matmul work than pass 1, so the passes alone account for k=3 / k=1 up to {3 + 2 * extra:.3f}.")
    columns = [("variant", 36), ("step ms", 9), ("tokens/s", 10), ("peak activations MiB", 21)]
    return report(results, title, columns, rows, notes=[ARCHITECTURE_NOTE, fusion])
