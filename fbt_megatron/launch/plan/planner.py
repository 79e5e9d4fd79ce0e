"""A recipe's plan for a world of GPUs: parameters, steps, layout, memory per GPU, FLOPs, wall time.

The model is built on the meta device (shapes only, no memory: fast for fbt-1b) at TP = PP = 1,
from the local spec whatever this machine has (Transformer Engine's has the same shapes); per-rank counts follow from megatron's sharding: the column/row-parallel linears and the
vocab-parallel embedding are split over TP, everything else (norms, the fusion) is replicated; PP
gives each stage its share of the layers, the first stage the embedding and fusion, the last the
final norm and (tied, PP > 1) a copy of the embedding for the logits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from fbt_megatron.common.gpus import GPU
from fbt_megatron.launch.plan import device, memory, timing
from fbt_megatron.model import flops as flops_lib
from fbt_megatron.recipe import Recipe, RecipeError

HEADROOM = 0.9  # above this share of the GPU's memory the plan warns (transients, fragmentation)


@dataclass
class Plan:
    recipe: Recipe
    world_size: int
    gpu: Optional[GPU]
    gpu_memory: Optional[float]  # bytes a training process can use (``device.usable_bytes``)
    mfu: float
    config: object
    params_total: int
    fusion_params: int
    stages: List[memory.Stage]
    layout: memory.Layout
    steps_per_k: Dict[int, float]
    max_passes: int
    memory: Dict[str, memory.Estimate]  # the worst stage's estimate under each activation setting
    chosen: str  # the recipe's own activation setting (a key of ``memory``)
    flops_single: float  # per token, k = 1
    flops_expected: float  # per token, averaged over the pass schedule
    tokens: int = 0
    optimizer_flops: float = 0.0  # per step, over all ranks: NorMuon's Newton–Schulz (``flops.normuon_flops_per_step``)
    newton_schulz: float = 0.0  # per step, on the GPU that runs the most of it (``timing.busiest_newton_schulz``)
    flops_megatron: float = 0.0  # per token by Megatron-LM's formula, averaged over the pass schedule
    cp_comm_type: Optional[str] = None  # context parallelism's communication type (CP > 1)
    notes: List[str] = field(default_factory=list)

    @property
    def time(self) -> Dict[str, float]:
        """Seconds of the run per term (``timing.wall_time``); {} without a peak."""
        return timing.wall_time(self)

    @property
    def train_seconds(self) -> Optional[float]:
        return sum(self.time.values()) if self.peak_tflops is not None else None

    @property
    def logged_mfu(self) -> Optional[float]:
        """The MFU the training log would show over the planned wall time (model FLOPs, ``flops.py``)."""
        seconds = self.train_seconds
        return None if seconds is None else self.flops_expected * self.tokens / (seconds * self.world_size * self.peak_tflops * 1e12)

    @property
    def megatron_mfu(self) -> Optional[float]:
        """The same run's MFU by Megatron-LM's formula (``timing.megatron_flops_per_token``)."""
        mfu = self.logged_mfu
        return None if mfu is None else mfu * self.flops_megatron / self.flops_expected

    @property
    def peak_tflops(self) -> Optional[float]:
        return self.recipe.logging.peak_tflops or (self.gpu.bf16_tflops if self.gpu else None)


@contextlib.contextmanager
def _single_process_group():
    """megatron's parallel state for one process at TP = PP = 1 while the meta model is built
    (a private one when none exists: a run plans before its own is created). Its group is torch's
    ``fake`` backend, which communicates with no one and opens no socket: a gloo group's sockets
    took ports of the moment, one of them the port a run's rank 0 was about to bind for its
    rendezvous (EADDRINUSE)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def model_config(recipe: Recipe, vocab_size: int):
    """The FBTConfig the run builds (``config.recipe_config``), for TP = PP = 1 on the meta device."""
    from fbt_megatron.model.config import recipe_config

    o = recipe.optimizer
    return recipe_config(recipe, vocab_size, bf16=o.bf16, fp16=o.fp16, use_cpu_initialization=True, perform_initialization=False)


def vocab_size(recipe: Recipe) -> int:
    """The embedding's rows: the corpus tokenizer's size (``data.vocab_size``) when the recipe prepares
    its corpus, else the preset's (the user's tokenizer decides at run time), padded as the run pads."""
    from fbt_megatron.data.tokenizer import padded_vocab_size
    from fbt_megatron.model.config import PRESETS

    d = recipe.data
    raw = d.vocab_size if d.train_data_path is None else PRESETS[recipe.model.preset]["vocab_size"]
    return padded_vocab_size(raw, recipe.parallel.tensor_model_parallel_size, d.make_vocab_size_divisible_by)


def stages(model, recipe: Recipe) -> List[memory.Stage]:
    """Per-rank parameter counts of every pipeline stage (module docstring), and each parameter as the
    optimizer sees it (``memory.Param``: NorMuon's or not, its second moment's rows, the FLOPs of its
    orthogonalisation by the rank that runs it)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    from fbt_megatron.optimizers import uses_normuon

    p, o = recipe.parallel, recipe.optimizer
    tp, pp, layers = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, model.config.num_layers
    if layers % pp:
        raise RecipeError(f"parallel.pipeline_model_parallel_size {pp} does not divide the {layers} layers")
    kinds = {name: type(module) for name, module in model.named_modules()
             if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))}
    out = [memory.Stage(rank=r, layers=layers // pp, params=0, matrix_params=0, matrix_rows=0, first=r == 0,
                        last=r == pp - 1) for r in range(pp)]
    for name, param in model.named_parameters():
        kind = kinds.get(name.rsplit(".", 1)[0])
        count = param.numel() // tp if kind else param.numel()
        rows = param.shape[0] // tp if kind and kind is not RowParallelLinear else param.shape[0]
        if name.startswith("decoder.layers."):
            owners = [out[int(name.split(".")[2]) // (layers // pp)]]
        elif name.startswith("embedding."):
            owners = [out[0]] + ([out[-1]] if pp > 1 else [])  # the tied output layer's copy
        elif name.startswith("feedback_fusion."):
            owners = [out[0]]
        else:
            owners = [out[-1]]
        matrix = o.optimizer == "normuon" and uses_normuon(name, param, o.adam_params)
        ns = _newton_schulz(name, param, kind, model.config, recipe) if matrix else 0.0
        for stage in owners:
            stage.params += count
            stage.parameters.append(memory.Param(count, rows, matrix, ns))
            if name.startswith("embedding.word_embeddings") or name.startswith("output_layer."):
                stage.embedding_params += count
            if matrix:
                stage.matrix_params += count
                stage.matrix_rows += rows
                stage.largest_matrix = max(stage.largest_matrix, param.numel())
    return out


def _newton_schulz(name: str, param, kind, config, recipe: Recipe) -> float:
    """FLOPs of NorMuon's Newton–Schulz on one matrix (``optimizers/normuon.py``): the whole matrix
    (``duplicated`` TP mode: its owner gathers the shards) or a TP rank's shard (``blockwise``),
    QKV per Q, K and V over all query groups (``muon_split_qkv``)."""
    from megatron.core.tensor_parallel import RowParallelLinear

    o, tp = recipe.optimizer, recipe.parallel.tensor_model_parallel_size
    rows, cols = param.shape
    if o.muon_tp_mode == "blockwise" and kind is not None:
        rows, cols = (rows, cols // tp) if kind is RowParallelLinear else (rows // tp, cols)
    h, g = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    parts = [rows * h // (h + 2 * g), rows * g // (h + 2 * g), rows * g // (h + 2 * g)] \
        if name.endswith("linear_qkv.weight") and o.muon_split_qkv else [rows]
    return sum(timing.newton_schulz_flops(r, cols, o.muon_num_ns_steps) for r in parts)


ACTIVATION_SETTINGS = {  # label: model fields
    "plain": dict(recompute_passes=False, recompute_granularity=None, offload_recompute_inputs=False),
    "recompute_passes": dict(recompute_passes=True, recompute_granularity=None, offload_recompute_inputs=False),
    "recompute_passes + offload": dict(recompute_passes=True, recompute_granularity=None, offload_recompute_inputs=True),
    "full recompute": dict(recompute_passes=False, recompute_granularity="full", offload_recompute_inputs=False),
    "full recompute + offload": dict(recompute_passes=False, recompute_granularity="full", offload_recompute_inputs=True),
}


def _setting(config) -> str:
    for label, fields in ACTIVATION_SETTINGS.items():
        if all(getattr(config, k) == v for k, v in fields.items()):
            return label
    return "recipe"


def make_plan(recipe: Recipe, world_size: int, gpu: Optional[GPU] = None, gpu_memory_gb: Optional[float] = None,
              mfu: float = 0.4, transformer_engine: Optional[bool] = None) -> Plan:
    """The plan of ``recipe`` on ``world_size`` GPUs (``gpu`` from the table, and/or ``gpu_memory_gb``:
    the GiB CUDA reports, of which ``device.RESERVED_GIB`` is not usable); RecipeError when the layout
    does not fit the world or the memory. ``transformer_engine``: count the TE spec's activations
    (flash attention; default: on a GPU plan) or the local spec's (CPU); packed SFT rows run the
    local attention core either way."""
    from fbt_megatron.model.fbt_model import FBTModel, fbt_model_spec
    from fbt_megatron.trainer.passes import pass_schedule

    if not 0 < mfu <= 1:
        raise RecipeError(f"--mfu must be in (0, 1], got {mfu}")
    fit = batch_fit(recipe, world_size)
    if fit is not None:
        raise RecipeError(fit.problem(fit_flag=False))  # (train --dry-run has no --fit-global-batch)
    recipe.validate(world_size, this_machine=False)  # a plan for GPUs: CP's Transformer Engine is theirs
    t, p, o = recipe.training, recipe.parallel, recipe.optimizer
    config = model_config(recipe, vocab_size(recipe))
    with _single_process_group(), torch.device("meta"):
        model = FBTModel(config, fbt_model_spec(config, use_transformer_engine=False))  # its shapes: the same on any machine
    params = dict(model.named_parameters())
    dp = world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)
    on_gpu = gpu is not None or gpu_memory_gb is not None
    layout = memory.Layout(
        tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size, dp=dp,
        sequence_parallel=p.sequence_parallel, micro_batch_size=t.micro_batch_size, seq_length=recipe.data.seq_length,
        microbatches=t.global_batch_size // (t.micro_batch_size * dp), optimizer=o.optimizer,
        distributed_optimizer=p.use_distributed_optimizer, half=o.bf16 or o.fp16,
        transformer_engine=on_gpu if transformer_engine is None else transformer_engine, packed_rows=recipe.data.sft,
        cpu=not on_gpu, async_save=recipe.checkpoint.async_save,
    )
    schedule = pass_schedule(recipe)
    steps_per_k = {k: n for k, n in sorted(schedule.expected_passes(t.train_iters).items()) if n > 0}
    max_passes = max(k for phase in schedule.phases for k, w in phase.mixture.items() if w > 0)
    if not config.latent_feedback and max_passes > 1:
        raise RecipeError(f"passes: the schedule asks for k = {max_passes} but the model has no latent feedback (latent_feedback: false)")
    stage_list = stages(model, recipe)
    chosen = _setting(config)
    estimates = {label: max((memory.estimate(varied, layout, s, max_passes) for s in stage_list), key=lambda e: e.total)
                 for label, varied in _varied_configs(recipe, config, chosen)}
    flops_single = flops_lib.flops_per_token(config, 1)
    flops_expected = flops_lib.expected_flops_per_token(config, steps_per_k)
    mean_passes = sum(k * n for k, n in steps_per_k.items()) / sum(steps_per_k.values())
    plan = Plan(
        recipe=recipe, world_size=world_size, gpu=gpu, mfu=mfu, config=config,
        gpu_memory=device.usable_bytes(gpu, gpu_memory_gb),
        params_total=sum(q.numel() for q in params.values()),
        fusion_params=sum(q.numel() for n, q in params.items() if n.startswith("feedback_fusion.")),
        stages=stage_list, layout=layout, steps_per_k=steps_per_k, max_passes=max_passes, memory=estimates,
        chosen=chosen, flops_single=flops_single, flops_expected=flops_expected,
        tokens=t.train_iters * t.global_batch_size * recipe.data.seq_length, optimizer_flops=optimizer_flops(recipe, config, dp),
        newton_schulz=timing.busiest_newton_schulz(stage_list, layout, o.muon_tp_mode == "blockwise") if o.optimizer == "normuon" else 0.0,
        flops_megatron=flops_expected + mean_passes * (timing.megatron_flops_per_token(config, recipe.data.seq_length) - flops_single),
        cp_comm_type=cp_comm_type(recipe),
    )
    check_fits(plan)
    return plan


def cp_comm_type(recipe: Recipe) -> Optional[str]:
    """The communication type context parallelism will run (None at CP 1): the run's own config
    decides it (``config.windowed_cp_comm_type`` for a sliding window, through ``Recipe.model_config``),
    and megatron-core's TE attention passes 'p2p' where it is unset (extensions/transformer_engine.py)."""
    if recipe.parallel.context_parallel_size == 1:
        return None
    return recipe.model_config().cp_comm_type or "p2p"


def _varied_configs(recipe: Recipe, config, chosen: str):
    """(label, model config) of every activation setting, and the recipe's own when it is none of them."""
    for label, fields in [*ACTIVATION_SETTINGS.items(), ("recipe", {})]:
        if label == "recipe" and chosen != "recipe":
            continue
        varied = model_config(recipe, config.vocab_size)
        for key, value in fields.items():
            setattr(varied, key, value)
        yield label, varied


def optimizer_flops(recipe: Recipe, config, dp: int) -> float:
    """NorMuon's Newton–Schulz FLOPs per step over all ranks: each matrix once under the distributed
    optimizer (layer-wise ownership over DP × CP), once per DP × CP replica without it; 0 for Adam/SGD."""
    o, p = recipe.optimizer, recipe.parallel
    if o.optimizer != "normuon":
        return 0.0
    once = flops_lib.normuon_flops_per_step(config, o.muon_num_ns_steps, o.muon_split_qkv)
    return once if p.use_distributed_optimizer else once * dp * p.context_parallel_size


# ---------------------------------------------------------------- fitting the global batch to a world
@dataclass
class BatchFit:
    """A global batch that does not split evenly over a world's data-parallel ranks, and the
    nearest ones that do (``options``: the one below, if any, and the one above), each with the
    train_iters that keeps the recipe's token budget (rounded up: never fewer tokens)."""

    recipe: Recipe
    world_size: int
    dp: int
    options: List[Tuple[int, int]]  # (global batch, train_iters)

    @property
    def nearest(self) -> Tuple[int, int]:
        """The option closest to the recipe's global batch (the smaller one on a tie)."""
        gbs = self.recipe.training.global_batch_size
        return min(self.options, key=lambda option: (abs(option[0] - gbs), option[0]))

    @staticmethod
    def flags(option: Tuple[int, int]) -> str:
        return f"--global-batch-size {option[0]} --train-iters {option[1]}"

    def problem(self, fit_flag: bool = True) -> str:
        """The refusal: what does not divide, the nearest batches that do with their --train-iters
        (``fit_flag``: and that --fit-global-batch, a flag of the planner and of Slurm's submit, applies one)."""
        t, pp = self.recipe.training, self.recipe.parallel.pipeline_model_parallel_size
        if t.global_batch_size % (t.micro_batch_size * self.dp):
            what = (f"training.global_batch_size {t.global_batch_size} is not a multiple of micro_batch_size "
                    f"{t.micro_batch_size} x data-parallel size {self.dp}")
        else:
            micro = t.global_batch_size // (t.micro_batch_size * self.dp)
            what = (f"training.global_batch_size {t.global_batch_size} gives {micro} microbatch{'es' if micro > 1 else ''} "
                    f"per step (micro batch {t.micro_batch_size} x DP {self.dp}), not a multiple of "
                    f"pipeline_model_parallel_size {pp}")
        options = " or ".join(self.flags(o) for o in self.options)
        return (f"{what} on {self.world_size} GPUs; the nearest that fit, with the --train-iters that keep the run's "
                f"{_count(t.train_iters * t.global_batch_size * self.recipe.data.seq_length)} tokens: {options}"
                + (" (--fit-global-batch applies the nearest)" if fit_flag else ""))

    def apply(self) -> str:
        """Set the recipe's global batch and train_iters to the nearest option; the note saying so."""
        t = self.recipe.training
        before = (t.global_batch_size, t.train_iters)
        t.global_batch_size, t.train_iters = self.nearest
        return (f"--fit-global-batch: global batch {before[0]} → {t.global_batch_size} sequences (DP {self.dp} on "
                f"{self.world_size} GPUs), --train-iters {before[1]} → {t.train_iters} (the same "
                f"{_count(before[0] * before[1] * self.recipe.data.seq_length)} tokens, rounded up)")


def batch_fit(recipe: Recipe, world_size: int) -> Optional[BatchFit]:
    """The BatchFit of a recipe whose global batch does not divide over ``world_size`` ranks; None
    when it does, or when the layout itself is invalid (``Recipe.validate`` says what)."""
    t, p = recipe.training, recipe.parallel
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    sizes = (t.micro_batch_size, t.global_batch_size, t.train_iters, model_parallel, p.pipeline_model_parallel_size)
    if min(sizes) < 1 or world_size % model_parallel:
        return None
    dp = world_size // model_parallel
    unit = t.micro_batch_size * dp * p.pipeline_model_parallel_size  # whole microbatches, whole pipeline rounds
    if t.global_batch_size % unit == 0:
        return None
    below, above = t.global_batch_size // unit * unit, (t.global_batch_size // unit + 1) * unit
    tokens = t.train_iters * t.global_batch_size  # in sequences; the sequence length is the same
    options = [(g, -(-tokens // g)) for g in (below, above) if g > 0]
    return BatchFit(recipe=recipe, world_size=world_size, dp=dp, options=options)


def check_fits(plan: Plan) -> None:
    """Refuse (RecipeError, one line naming the largest term and its fix) a layout whose estimate
    exceeds the GPU's usable memory; note one above ``HEADROOM`` of it."""
    if plan.gpu_memory is None:
        return
    est = plan.memory[plan.chosen]
    if est.total > plan.gpu_memory:
        term, size = max(est.terms.items(), key=lambda kv: kv[1])
        raise RecipeError(
            f"does not fit: {gib(est.total)} GiB per GPU estimated (pipeline stage {est.stage}) > {gib(plan.gpu_memory)} GiB "
            f"usable (the CUDA context and NCCL's buffers set aside); {term} alone {gib(size)} GiB{_fix(plan, est, term)}"
        )
    if est.total > HEADROOM * plan.gpu_memory:
        plan.notes.append(f"warning: {est.total / plan.gpu_memory:.0%} of the GPU's usable memory: little headroom")


def _fix(plan: Plan, est: memory.Estimate, term: str) -> str:
    """The refusal's hint for its largest term; for the local attention core's s × s scores (packed
    SFT rows), the flags that shrink them."""
    if term != "activations":
        return " (try more TP/PP, or the distributed optimizer over more DP ranks)"
    if 2 * est.scores < est.terms["activations"]:
        return " (try recompute_passes, recompute_granularity full, or a smaller micro batch)"
    lay, c = plan.layout, plan.config
    fixes = (["--recompute-passes true"] if plan.max_passes > 1 and not c.recompute_passes else []) + \
        ([f"--micro-batch-size {lay.micro_batch_size // 2}"] if lay.micro_batch_size > 1 else []) + ["a shorter --seq-length"]
    return (f", of which {gib(est.scores)} GiB the s × s attention scores that megatron's local core keeps for packed "
            f"SFT rows (b·h/TP·s² per layer): try {', or '.join(fixes)}")


def gib(value: float) -> str:
    return f"{value / 2**30:.1f}" if value >= 2**30 or value == 0 else f"{value / 2**30:.3f}"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _duration(seconds: float) -> str:
    hours = seconds / 3600
    return f"{hours / 24:.1f} days" if hours >= 48 else f"{hours:.1f} h" if hours >= 1 else f"{seconds / 60:.0f} min"


def format_plan(plan: Plan) -> str:
    """The plan as the text ``python -m fbt_megatron.plan`` and ``--dry-run`` print."""
    r, lay, c = plan.recipe, plan.layout, plan.config
    t = r.training
    gpu = plan.gpu.name if plan.gpu else (f"{gib(plan.gpu_memory)} GiB GPU" if plan.gpu_memory else "no GPU (CPU)")
    lines = [
        f"plan: {r.model.preset}{'' if c.latent_feedback else ' (baseline: no latent feedback)'} on {plan.world_size} × {gpu}",
        f"  model: {c.num_layers} layers, D {c.hidden_size}, FFN {c.ffn_hidden_size}, heads {c.num_attention_heads}/"
        f"{c.num_query_groups or c.num_attention_heads} of {c.kv_channels}, vocabulary {c.vocab_size:,}, sequence {lay.seq_length:,}",
        f"  parameters: {plan.params_total:,} ({_count(plan.params_total)}; fusion {plan.fusion_params:,}); per rank "
        + ", ".join(f"stage {s.rank} {s.params:,}" for s in plan.stages) + f" (TP {lay.tp}, PP {lay.pp})",
        f"  layout: TP {lay.tp} × PP {lay.pp} × CP {lay.cp}{f' over {plan.cp_comm_type}' if plan.cp_comm_type else ''} × DP {lay.dp}"
        f" = {plan.world_size}{', sequence parallel' if lay.sequence_parallel else ''}"
        f"{', distributed optimizer' if lay.distributed_optimizer else ''}",
        f"  steps: {t.train_iters:,} × {t.global_batch_size} sequences × {lay.seq_length:,} tokens = "
        f"{plan.tokens:,} tokens ({_count(plan.tokens)}); microbatches per step and DP rank: {lay.microbatches} of {lay.micro_batch_size}",
        "  passes: " + ", ".join(f"k={k}: {n:,.0f} steps" for k, n in plan.steps_per_k.items())
        + f" (expected; peak memory at k = {plan.max_passes})",
        f"  FLOPs per token (model FLOPs, fwd+bwd): {plan.flops_single / 1e9:.4g} G at k = 1, "
        f"{plan.flops_expected / 1e9:.4g} G with the pass schedule (×{plan.flops_expected / plan.flops_single:.3f}); "
        f"run total {plan.flops_expected * plan.tokens:.3e}; by Megatron-LM's formula (full causal attention in every "
        f"layer) {plan.flops_megatron / 1e9:.4g} G (×{plan.flops_megatron / plan.flops_expected:.3f})"
        + (f"; NorMuon's Newton–Schulz {plan.optimizer_flops:.3g} per step, {plan.newton_schulz:.3g} on the busiest GPU"
           if plan.optimizer_flops else ""),
        _wall_time_line(plan),
    ]
    attention = ("Transformer Engine spec" if lay.transformer_engine else "local spec") + \
        (", megatron's local attention core for packed SFT rows (s × s scores)" if lay.transformer_engine and lay.local_core
         else " (s × s attention scores)" if lay.local_core else "")
    lines.append(f"  memory per GPU, GiB (the fullest pipeline stage, {attention}, micro batch {lay.micro_batch_size}, k = {plan.max_passes}):")
    for label, est in plan.memory.items():
        terms = ", ".join(f"{name} {gib(v)}" for name, v in est.terms.items())
        mark = "  <- this recipe" if label == plan.chosen else ""
        where = f"stage {est.stage}: " if lay.pp > 1 else ""
        scores = f", s × s scores {gib(est.scores)}" if est.scores else ""
        lines.append(f"    {label:<26} total {gib(est.total):>6}  ({where}{terms}; of which logits {gib(est.logits)}{scores}){mark}")
    if plan.gpu_memory is not None:
        lines.append(f"  fits: {gib(plan.memory[plan.chosen].total)} of {gib(plan.gpu_memory)} GiB usable "
                     f"({device.RESERVED_GIB:g} GiB of what CUDA reports set aside for its context and NCCL's buffers)")
    return "\n".join(lines + plan.notes)


def _wall_time_line(plan: Plan) -> str:
    """The wall time, its terms (``timing``), and the MFU the log would show by both formulas."""
    if plan.train_seconds is None:
        return "  wall time: no peak TFLOP/s known (give --gpu or --peak-tflops)"
    terms = {"model FLOPs": f"model FLOPs at {plan.mfu:.0%} MFU of {plan.peak_tflops:g} TFLOP/s",
             "Newton–Schulz": f"NorMuon's Newton–Schulz in FP32 at {plan.mfu:.0%} of its peak",
             "local attention core": "the local attention core's s × s work (memory-bound)"}
    parts = "; ".join(f"{terms[name]}: {_duration(seconds)}" for name, seconds in plan.time.items())
    return (f"  wall time: {_duration(plan.train_seconds)} ({parts}); the log's MFU over it {plan.logged_mfu:.1%}, "
            f"{plan.megatron_mfu:.1%} by Megatron-LM's formula")


def print_plan(recipe: Recipe, world_size: int) -> None:
    """``train --dry-run``: the plan for this world and this machine's GPU (none on CPU: its memory as
    CUDA reports it), printed once (rank 0); a layout that does not fit raises RecipeError on every rank."""
    import os

    from fbt_megatron.common.gpus import current

    cuda_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None
    plan = make_plan(recipe, world_size, current(), cuda_gib)
    if os.environ.get("RANK", "0") == "0":
        print(format_plan(plan), flush=True)
