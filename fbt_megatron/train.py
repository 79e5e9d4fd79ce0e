"""Pretraining entry point: ``python -m fbt_megatron.train --recipe recipes/NAME.yaml [overrides]``.

Runs alone (one process) or under ``torchrun``/``srun``. Overrides use Megatron-LM's argument
names (``--train-iters 200 --micro-batch-size 4 --tensor-model-parallel-size 2 --save runs/x``).
The step, top to bottom: pick k for this step (the pass schedule) → run megatron-core's
forward-backward schedule over the microbatches, each doing k passes (``parallel.pipeline``: all
passes in one forward step at PP = 1, passes as virtual pipeline chunks at PP > 1) → reduce
gradients (DDP) → optimizer step → learning-rate step → log / validate / checkpoint.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from fbt_megatron import checkpointing, flags, platform, stages
from fbt_megatron.bad_steps import BadSteps, NaNInjection, optimizer_step
from fbt_megatron.cli import quiet_library_warnings, run_cli
from fbt_megatron.fbt import PackedRows, PassPhase, PassSchedule, pass_weights
from fbt_megatron.losses import z_loss_coefficient
from fbt_megatron.metrics import MetricsLogger, PassShares
from fbt_megatron.plan.flops import Throughput, flops_per_token
from fbt_megatron.plan.gpus import peak_tflops
from fbt_megatron.recipe import Recipe, RecipeError
from fbt_megatron.stopping import StopCheck, stop_line, write_status


DESCRIPTION = ("Train an FBT model (or its baseline) from a recipe, alone or under torchrun/srun. "
               "Every recipe field is a flag; the defaults shown are the recipe's.")


# ---------------------------------------------------------------- building blocks
def build_model(recipe: Recipe, vocab_size: int):
    """This pipeline stage's FBTModel in megatron-core DDP (gradient buffers, reduction over
    data-parallel ranks)."""
    from fbt_megatron.parallel import data as parallel_data
    from fbt_megatron.parallel import pipeline
    from fbt_megatron.config import make_config
    from fbt_megatron.model import FBTModel, fbt_model_spec
    from fbt_megatron import optimizers

    o, p = recipe.optimizer, recipe.parallel
    dtype = torch.bfloat16 if o.bf16 else torch.float16 if o.fp16 else torch.float32
    config = make_config(
        recipe.model.preset,
        **{
            **recipe.model_overrides,
            "vocab_size": vocab_size,
            "seq_length": recipe.data.seq_length,
            "tensor_model_parallel_size": p.tensor_model_parallel_size,
            "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "sequence_parallel": p.sequence_parallel,
            "context_parallel_size": p.context_parallel_size,
            "bf16": o.bf16,
            "fp16": o.fp16,
            "params_dtype": dtype,
        },
    )
    spec = fbt_model_spec(config, local_attention=recipe.data.sft)  # packed SFT rows: an explicit attention mask
    model = FBTModel(config, spec, **pipeline.stage()).to(device=platform.device(), dtype=dtype)
    ddp = parallel_data.wrap(config, model, p.overlap_grad_reduce, optimizers.ddp_shards_gradients(recipe))
    return config, model, ddp


def build_optimizer(recipe: Recipe, config, ddp, schedule: Optional[dict] = None):
    """The run's optimizer (``fbt_megatron.optimizers``: megatron-core's Adam or SGD with weight
    decay off for norms and 1-D parameters, or NorMuon for the matrices + Adam for the rest) and
    its learning-rate scheduler following ``schedule`` (default: the recipe's, ``lr_schedule``)."""
    from fbt_megatron import optimizers

    optimizer = optimizers.build_optimizer(recipe, config, ddp)
    config.grad_scale_func = optimizer.scale_loss
    return optimizer, build_scheduler(optimizer, schedule or lr_schedule(recipe))


# ---------------------------------------------------------------- the learning-rate schedule
def lr_schedule(recipe: Recipe) -> dict:
    """The flags that define the learning-rate and weight-decay curve (saved in every checkpoint,
    so that a resumed run knows whether its curve is the one the checkpoint was trained on)."""
    o = recipe.optimizer
    schedule = {"lr": o.lr, "min_lr": o.min_lr, "lr_warmup_iters": o.lr_warmup_iters,
                "train_iters": recipe.training.train_iters, "lr_decay_style": o.lr_decay_style, "weight_decay": o.weight_decay}
    if o.weight_decay_schedule != "constant":  # recorded when not the default: older checkpoints stay resumable
        schedule["weight_decay_schedule"] = o.weight_decay_schedule
    if o.optimizer == "normuon":
        schedule["adam_lr"] = o.lr if o.adam_lr is None else o.adam_lr
    if o.lr_decay_style == "WSD":
        schedule.update(lr_wsd_decay_style=o.lr_wsd_decay_style, lr_wsd_decay_fraction=o.lr_wsd_decay_fraction)
    return schedule


def _wsd_decay_iters(schedule: dict) -> int:
    return round(schedule["lr_wsd_decay_fraction"] * schedule["train_iters"])


def cooldown_start(schedule: dict) -> Optional[int]:
    """The first step of the cooldown: the first 0-based iteration whose learning rate is below its
    peak (WSD: the last ``lr_wsd_decay_fraction`` of the run; cosine and linear: after warmup;
    constant: none). megatron-core's scheduler keeps the peak at the decay's start step
    (lr(i) = peak for i <= start), so the cooldown begins one later. AdamC's weight decay and the
    z-loss switch on there."""
    style = schedule["lr_decay_style"]
    if style == "WSD":
        return schedule["train_iters"] - _wsd_decay_iters(schedule) + 1
    return None if style == "constant" else schedule["lr_warmup_iters"] + 1


def build_scheduler(optimizer, schedule: dict):
    """megatron-core's OptimizerParamScheduler for ``schedule`` (with AdamC weight decay in the
    cooldown when asked: ``optimizers.schedule``). It is the curve this run chose
    (``choose_schedule``), so loading a checkpoint restores only its step count. Every param group
    peaks at its own ``max_lr`` (Adam's at ``adam_lr`` under normuon)."""
    from fbt_megatron.optimizers.schedule import WeightDecayScheduler

    wsd = schedule["lr_decay_style"] == "WSD"
    adamc = schedule.get("weight_decay_schedule") == "adamc"
    return WeightDecayScheduler(
        optimizer,
        adamc_from=cooldown_start(schedule) if adamc else None,
        init_lr=0.0,
        max_lr=schedule["lr"],
        min_lr=schedule["min_lr"],
        lr_warmup_steps=schedule["lr_warmup_iters"],
        lr_decay_steps=schedule["train_iters"],
        lr_decay_style=schedule["lr_decay_style"],
        start_wd=schedule["weight_decay"],
        end_wd=schedule["weight_decay"],
        wd_incr_steps=schedule["train_iters"],
        wd_incr_style="constant",
        wsd_decay_steps=_wsd_decay_iters(schedule) if wsd else None,
        lr_wsd_decay_style=schedule["lr_wsd_decay_style"] if wsd else None,
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )


def describe_schedule(schedule: dict, train_iters: int) -> str:
    """The learning-rate curve in words, e.g. "warmup to 3.0e-03 over 20 steps, constant to step
    600, linear decay to 0.0e+00 at step 800"."""
    s, end = schedule, schedule["train_iters"]
    parts = [f"warmup to {s['lr']:.1e} over {s['lr_warmup_iters']} steps" if s["lr_warmup_iters"] else f"{s['lr']:.1e} from step 1"]
    if s["lr_decay_style"] == "WSD":
        parts += [f"constant to step {end - _wsd_decay_iters(s)}", f"{s['lr_wsd_decay_style']} decay to {s['min_lr']:.1e} at step {end}"]
    elif s["lr_decay_style"] == "constant":
        parts.append("constant")
    else:
        parts.append(f"{s['lr_decay_style']} decay to {s['min_lr']:.1e} at step {end}")
    if train_iters > end and s["lr_decay_style"] != "constant":
        parts.append(f"then {s['min_lr']:.1e} to step {train_iters}")
    if "adam_lr" in s:
        parts.append(f"Adam's peak {s['adam_lr']:.1e}")
    if s.get("weight_decay_schedule") == "adamc":
        parts.append("AdamC weight decay in the cooldown")
    return ", ".join(parts)


def _curve(schedule: dict) -> dict:
    """What shapes the curve: a constant learning rate does not depend on the run's length."""
    return {k: v for k, v in schedule.items() if not (k == "train_iters" and schedule["lr_decay_style"] == "constant")}


def choose_schedule(recipe: Recipe, saved: Optional[dict]) -> Tuple[dict, Optional[str]]:
    """The learning-rate schedule of this run, and a note when resuming changes it. As in
    Megatron-LM, a checkpoint trained on another curve (a longer --train-iters, a new --lr, warmup
    or decay) is refused unless the run says which curve applies:
    ``--override-opt-param-scheduler`` (this run's, recomputed for its length) or
    ``--use-checkpoint-opt-param-scheduler`` (the checkpoint's, whatever the flags say)."""
    ours = lr_schedule(recipe)
    theirs = saved.get("lr_schedule") if saved else None
    if theirs is None or _curve(theirs) == _curve(ours):
        return ours, None
    changed = ", ".join(
        f"{flags.flag(key)} {flags.show(theirs.get(key))} → {flags.show(ours.get(key))}"
        for key in [*ours, *(k for k in theirs if k not in ours)] if theirs.get(key) != ours.get(key)
    )
    c = recipe.checkpoint
    if c.override_opt_param_scheduler:
        return ours, f"learning-rate schedule changed since the checkpoint ({changed}): this run's applies (--override-opt-param-scheduler)"
    if c.use_checkpoint_opt_param_scheduler:
        return theirs, f"learning-rate schedule changed since the checkpoint ({changed}): the checkpoint's applies (--use-checkpoint-opt-param-scheduler)"
    raise RecipeError(
        f"the checkpoint in {c.load} (step {saved['iteration']}) was trained with another learning-rate schedule ({changed}): "
        f"add --override-opt-param-scheduler to apply this run's from step {saved['iteration'] + 1}, "
        f"or --use-checkpoint-opt-param-scheduler to keep the checkpoint's"
    )


def pass_schedule(recipe: Recipe) -> PassSchedule:
    """The run's pass schedule: its phases (``Recipe.pass_phases``) drawn with the run's seed."""
    return PassSchedule(recipe.training.seed, tuple(PassPhase(start, mixture) for start, mixture in recipe.pass_phases()))


@dataclass
class Data:
    tokenizer: object
    train: object
    valid: object
    source: str


def build_data(recipe: Recipe, world_rank: int) -> Data:
    """Tokenizer and datasets: GPTDatasets of a corpus or a blend, the examples of a
    state-tracking task (``fbt_megatron.tasks.state_tracking``), or packed chat conversations
    (``--sft``: ``fbt_megatron.data.sft``). The embedded default corpus, the tasks and the tiny SFT
    set are prepared on first use (rank 0 prepares, the others wait)."""
    from fbt_megatron.data import sft
    from fbt_megatron.data.corpus import ensure_corpus, load_corpus
    from fbt_megatron.data.datasets import build_datasets
    from fbt_megatron.data.tokenizer import load_tokenizer
    from fbt_megatron.tasks import state_tracking

    d, t = recipe.data, recipe.training
    if d.sft:
        if recipe.parallel.context_parallel_size > 1:
            raise RecipeError("--sft packs conversations into rows, which context parallelism would split: use "
                              "--context-parallel-size 1")
        if d.train_data_path is None and sft.set_source(d.corpus):
            if world_rank == 0:
                sft.ensure_sft_set(d.corpus, d.data_path, d.tokenizer_model, d.seq_length)
            dist.barrier()
        tokenizer, train, valid, source = sft.load_sft_data(d, t.seed, report=world_rank == 0)
        return Data(tokenizer=tokenizer, train=train, valid=valid, source=source)
    gbs = t.global_batch_size
    num_samples = (t.train_iters * gbs, max(1, t.eval_iters) * gbs)
    task = state_tracking.task_name(d.corpus)
    if d.train_data_path is None and (task or (d.corpus is None and state_tracking.is_task_folder(d.data_path))):
        if task:
            if world_rank == 0:
                state_tracking.prepare_task(task, d.data_path, d.seq_length)
            dist.barrier()
        prepared = state_tracking.load_task(d.data_path)
        train, valid = (prepared.dataset(s, d.seq_length, n, t.seed) for s, n in zip(state_tracking.SPLITS, num_samples))
        return Data(tokenizer=prepared.vocabulary, train=train, valid=valid,
                    source=f"{d.data_path} ({prepared.group.name} state tracking)")
    if d.train_data_path is None:
        if d.corpus is not None:
            if world_rank == 0:
                ensure_corpus(d.corpus, d.data_path, vocab_size=d.vocab_size)
            dist.barrier()
        elif not (Path(d.data_path) / "corpus.json").is_file():
            raise RecipeError(f"data.data_path {d.data_path} is not a prepared corpus (no corpus.json)")
        corpus = load_corpus(d.data_path)
        tokenizer_path = d.tokenizer_model or corpus.tokenizer_path
        train_blend, valid_blend = ([corpus.train_prefix], None), ([corpus.valid_prefix], None)
        source, cache = str(d.data_path), d.data_cache_path or str(Path(d.data_path) / "cache")
    else:
        tokenizer_path = d.tokenizer_model
        train_blend = _blend(d.train_data_path, "data.train_data_path")
        valid_blend = _blend(d.valid_data_path, "data.valid_data_path") if d.valid_data_path else None
        source = " ".join(map(str, d.train_data_path))
        cache = d.data_cache_path or str(Path(recipe.checkpoint.save or ".") / "data_cache")
    tokenizer = load_tokenizer(tokenizer_path)
    train, valid, _ = build_datasets(
        tokenizer,
        seq_length=d.seq_length,
        seed=t.seed,
        num_samples=(*num_samples, None),
        cache_dir=cache,
        blend_per_split=[train_blend, valid_blend or train_blend, None],
    )
    return Data(tokenizer=tokenizer, train=train, valid=valid, source=source)


def _blend(spec: list, key: str):
    """Megatron's blend list ([w, prefix, w, prefix, ...] or [prefix, ...]) → (prefixes, weights)."""
    if all(isinstance(x, str) for x in spec):
        prefixes, weights = list(spec), None
    elif len(spec) % 2 == 0 and all(isinstance(w, (int, float)) for w in spec[0::2]):
        prefixes, weights = [str(p) for p in spec[1::2]], [float(w) for w in spec[0::2]]
    else:
        raise RecipeError(f"{key} must be [prefix, ...] or [weight, prefix, weight, prefix, ...]")
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).is_file():
                raise RecipeError(f"{key}: data file not found: {prefix + ext}")
    return prefixes, weights


# ---------------------------------------------------------------- batches
def sequence_seed(seed: int, sample: int) -> int:
    """The seed of a sample's prefix-mixin and jitter draws: fixed by (run seed, sample index)."""
    return seed * 1_000_003 + sample


def microbatches(dataset, first_sample: int, recipe: Recipe, dp_rank: int, dp_size: int):
    """This data-parallel rank's microbatches of the global batch starting at ``first_sample``.
    Global batch g holds samples [g·G, (g+1)·G); rank r takes its contiguous G/dp of them. Under
    context parallelism each CP rank keeps its load-balanced chunks of every sequence. Rows of
    packed conversations (SFT: items with ``segments`` and ``plain``) come with ``packed``
    (``fbt.PackedRows``)."""
    from megatron.core import parallel_state

    from fbt_megatron.parallel.sequence import shard_positions

    t = recipe.training
    cp = parallel_state.get_context_parallel_world_size()
    columns = shard_positions(recipe.data.seq_length, parallel_state.get_context_parallel_rank(), cp, 0, 1)
    per_rank = t.global_batch_size // dp_size
    start = first_sample + dp_rank * per_rank
    for m in range(per_rank // t.micro_batch_size):
        ids = range(start + m * t.micro_batch_size, start + (m + 1) * t.micro_batch_size)
        items = [dataset[i] for i in ids]
        batch = {
            key: torch.stack([torch.as_tensor(item[key]) for item in items])[:, columns].to(platform.device())
            for key in ("tokens", "labels", "loss_mask", "segments", "plain") if key in items[0]
        }
        batch["seeds"] = [sequence_seed(t.seed, i) for i in ids]
        if "segments" in batch:  # packed conversations (SFT): attention and feedback stay inside each
            batch["packed"] = PackedRows(batch.pop("segments"), batch.pop("plain"),
                                         prompt_prefix=recipe.data.sft_prefix_mixin == "prompt")
        yield batch


def run_schedule(recipe: Recipe, ddp, dataset, first_sample: int, num_passes: int, forward_only: bool, measure_deltas: bool = True):
    """One global batch through the pass-aware schedule (``parallel.pipeline``); returns this
    rank's per-pass losses and state deltas (tensors) averaged over its microbatches."""
    from megatron.core import parallel_state

    from fbt_megatron.parallel import pipeline

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    t = recipe.training
    reports = pipeline.forward_backward(
        ddp,
        list(microbatches(dataset, first_sample, recipe, dp_rank, dp_size)),
        num_passes,
        seq_length=recipe.data.seq_length,
        micro_batch_size=t.micro_batch_size,
        forward_only=forward_only,
        measure_deltas=measure_deltas,
    )
    out = {}
    for key in ("pass_losses", "state_delta_squares"):
        if reports and key in reports[0]:
            out[key] = torch.stack([r[key] for r in reports]).mean(0)
    return out


def data_parallel_mean(report: dict) -> dict:
    """A step's report averaged over data- and context-parallel ranks (and over the TP ranks, which
    hold shards of the sequence under SP), as floats (one host sync: log steps only); the mean
    squared state deltas become ‖Δs‖, the RMS over all tokens."""
    from megatron.core import parallel_state

    out = {}
    for key, value in report.items():
        value = value.clone()
        for group in (parallel_state.get_data_parallel_group(with_context_parallel=True), parallel_state.get_tensor_model_parallel_group()):
            dist.all_reduce(value, group=group)
            value /= dist.get_world_size(group)
        if key == "state_delta_squares":
            key, value = "state_deltas", value.sqrt()
        out[key] = value.tolist()
    return out


# ---------------------------------------------------------------- the run
@dataclass
class TrainState:
    """What besides weights and optimizer a resumed run needs (saved in every checkpoint)."""

    iteration: int = 0
    consumed_samples: int = 0
    tokens: int = 0
    compute_tokens: int = 0  # tokens × passes: the cost in equivalent single-pass tokens
    pass_schedule: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    lr_schedule: dict = field(default_factory=dict)  # the curve the optimizer followed (``lr_schedule``)
    recipe: dict = field(default_factory=dict)  # the whole recipe of the run's latest stretch (``runs.load_run``)
    vocab_size: int = 0  # the embedding's (padded) vocabulary size
    skipped_steps: int = 0  # steps whose update was skipped (NaN/Inf gradient norm: ``bad_steps``)


def evaluate(recipe: Recipe, config, ddp, valid) -> dict:
    """Validation loss after 0, 1, …, n fused prefill passes (eval mode: no prefix mixin, no jitter)."""
    n = recipe.training.fused_prefill_passes if config.latent_feedback else 0
    ddp.eval()
    losses = []
    with torch.no_grad():
        for i in range(recipe.training.eval_iters):
            first = i * recipe.training.global_batch_size
            report = run_schedule(recipe, ddp, valid, first, n + 1, forward_only=True)
            if report:  # the last pipeline stage
                losses.append(data_parallel_mean(report)["pass_losses"])
    ddp.train()
    if not losses:
        return {}
    mean = torch.tensor(losses).mean(0).tolist()
    return {f"valid_loss_fused{j}": v for j, v in enumerate(mean)}


def validation_note(valid, recipe: Recipe) -> Optional[str]:
    """A warning when validation asks for more sequences than the validation split holds (they
    repeat, so the loss is measured on less text than it seems)."""
    t, length = recipe.training, recipe.data.seq_length
    documents = getattr(valid, "dataset", None)
    if documents is None or not hasattr(valid, "indices"):  # a blend or another dataset class
        return None
    tokens = int(documents.sequence_lengths[valid.indices].sum())
    distinct, asked = max(1, (tokens - 1) // length), t.eval_iters * t.global_batch_size
    if not t.eval_iters or asked <= distinct:
        return None
    return (f"warning: validation reads {asked} sequences of {length} tokens but its split holds {tokens:,} tokens "
            f"({distinct} distinct sequences): they repeat; use a larger validation split or fewer --eval-iters")


def header(recipe: Recipe, model, vocab: int, data: Data, schedule: dict, start: int) -> str:
    from megatron.core import parallel_state

    t, p = recipe.training, recipe.parallel
    tokenizer_vocab = data.tokenizer.vocab_size
    return (
        f"fbt-megatron: {recipe.model.preset}, {sum(q.numel() for q in model.parameters()):,} parameters on this rank, "
        f"vocabulary {tokenizer_vocab:,}" + (f" (padded to {vocab:,})" if vocab != tokenizer_vocab else "") + "\n"
        f"  data {data.source}; world {dist.get_world_size()} (tp {p.tensor_model_parallel_size}, "
        f"pp {p.pipeline_model_parallel_size}, cp {p.context_parallel_size}, dp {parallel_state.get_data_parallel_world_size()}); "
        f"steps {start}→{t.train_iters} of {t.global_batch_size} × {recipe.data.seq_length} tokens\n"
        f"  learning rate: {describe_schedule(schedule, t.train_iters)}\n"
        f"  passes: {pass_schedule(recipe).describe()}\n"
        f"  model FLOPs per token (fwd+bwd, fbt_megatron.plan.flops): "
        + ", ".join(f"{flops_per_token(model.config, k):.3g} at k = {k}" for k in sorted(pass_schedule(recipe).expected_passes(t.train_iters)))
    )


def train(recipe: Recipe) -> List[dict]:
    """Train per the recipe; returns the logged records (also on stdout / metrics.jsonl / TensorBoard)."""
    began = time.monotonic()  # --exit-duration-in-mins counts from here
    t, c, g = recipe.training, recipe.checkpoint, recipe.logging
    if t.threads:
        torch.set_num_threads(t.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if t.dry_run:  # the plan for this world (fbt_megatron.plan), before any process group or data
        from fbt_megatron.plan.planner import print_plan

        print_plan(recipe, world)
        return []
    recipe.validate(world)
    warmup_note = recipe.clamp_warmup()
    origin = stages.start_of(recipe)  # resume, weights of another run (a stage), or None: from scratch
    saved = origin.saved if origin is not None and not origin.weights_only else None
    schedule, schedule_note = choose_schedule(recipe, saved)
    p = recipe.parallel
    platform.init_distributed(
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size, t.seed, context_parallel_size=p.context_parallel_size
    )
    rank = dist.get_rank()
    data = build_data(recipe, rank)
    vocab = data.tokenizer.padded_vocab_size(recipe.parallel.tensor_model_parallel_size, recipe.data.make_vocab_size_divisible_by)
    stages.check_vocabulary(origin, vocab)
    config, model, ddp = build_model(recipe, vocab)
    optimizer, scheduler = build_optimizer(recipe, config, ddp, schedule)
    passes = pass_schedule(recipe)
    pass_shares = PassShares(passes)
    state = TrainState(pass_schedule=passes.state_dict(), model=recipe.to_dict()["model"], lr_schedule=schedule,
                       recipe=recipe.to_dict(), vocab_size=vocab)

    if origin is not None:
        stages.load(origin, recipe, model, optimizer, scheduler)
    if saved is not None:
        state = TrainState(**{**saved, **{k: getattr(state, k) for k in ("pass_schedule", "lr_schedule", "recipe", "vocab_size")}})
    if c.create_seed_checkpoint:
        print(f"seed checkpoint: {checkpointing.save(c.save, state.iteration, model, None, None, vars(state))}", flush=True)
        return []

    is_logger = rank == dist.get_world_size() - 1  # last pipeline stage: it has the losses
    logger = MetricsLogger(c.save, active=is_logger, tensorboard=g.tensorboard, tensorboard_dir=g.tensorboard_dir,
                           resume_from=state.iteration)
    if is_logger:
        notes = [origin and origin.note, warmup_note, schedule_note, validation_note(data.valid, recipe)]
        print("\n".join([header(recipe, model, vocab, data, schedule, state.iteration), *filter(None, notes)]), flush=True)
    tokens_per_step = t.global_batch_size * recipe.data.seq_length
    throughput = Throughput(config, dist.get_world_size(), peak_tflops(g.peak_tflops), state.tokens, state.compute_tokens)
    records, window_time, window_steps = [], 0.0, 0
    stop = StopCheck(t.exit_duration_in_mins, t.exit_signal_handler, began)  # signals and the time budget
    injection, bad = NaNInjection(t.inject_nan), BadSteps(t.max_bad_steps, state.skipped_steps)
    newest = checkpointing.latest_iteration(c.save) if c.save else None
    last_checkpoint = None if newest is None else checkpointing.checkpoint_dir(c.save, newest)
    background = checkpointing.BackgroundSaves() if c.async_save else None  # --async-save
    ending = reason = None
    saves, save_time, loop_start, first_step = 0, 0.0, time.perf_counter(), state.iteration
    try:
        while state.iteration < t.train_iters:
            k = passes(state.iteration)
            start = time.perf_counter()
            log_step = (state.iteration + 1) % g.log_interval == 0 or state.iteration + 1 == t.train_iters
            stop.start_step()
            ddp.start_step(k)
            model.z_loss.start_step(z_loss_coefficient(t, cooldown_start(schedule), state.iteration))
            optimizer.zero_grad()
            with injection.forward(state.iteration + 1, model):
                report = run_schedule(recipe, ddp, data.train, state.consumed_samples, k, forward_only=False, measure_deltas=log_step)
            injection.gradient(state.iteration + 1, model)
            if report and t.z_loss_coeff:  # logged from the first step: 0 before the z-loss switches on
                report["z_loss"] = model.z_loss.value(config)
            updated, grad_norm = optimizer_step(optimizer)  # no update when the gradient norm is NaN/Inf
            if updated:
                scheduler.step(increment=1)
            bad.record(state.iteration + 1, updated, grad_norm)
            if bad.consecutive and is_logger:
                print(f"step {state.iteration + 1} skipped: gradient norm {grad_norm} ({bad.consecutive} in a row, "
                      f"{bad.skipped} in all)", flush=True)
            window_time += time.perf_counter() - start
            window_steps += 1
            state.iteration += 1
            state.consumed_samples += t.global_batch_size
            state.tokens += tokens_per_step
            state.compute_tokens += tokens_per_step * k
            state.skipped_steps = bad.skipped

            if log_step and not report:  # not the last pipeline stage: no losses here
                if t.eval_iters and (state.iteration % t.eval_interval == 0 or state.iteration == t.train_iters):
                    evaluate(recipe, config, ddp, data.valid)
            elif log_step:
                report = data_parallel_mean(report)
                losses = report["pass_losses"]
                record = {
                    "step": state.iteration,
                    "k": k,
                    "loss": sum(w * l for w, l in zip(pass_weights(config, k), losses)),
                    "pass_losses": losses,
                    "state_deltas": report.get("state_deltas", []),
                    "lr": scheduler.get_lr(optimizer.param_groups[0]),
                    "grad_norm": grad_norm,
                    "skipped_steps": bad.skipped,
                    "iteration_time": window_time / window_steps,
                    "tokens_per_s": window_steps * tokens_per_step / window_time,
                    "tokens": state.tokens,
                    "compute_tokens": state.compute_tokens,
                }
                record.update(throughput.fields(record))  # tokens/s and model TFLOP/s per GPU, MFU (fbt_megatron.plan.flops)
                record.update(pass_shares(state.iteration))  # the step's pass-schedule phase, the share of each k so far
                if "z_loss" in report:  # `loss` is the objective, cross-entropy + z; `pass_losses` stay cross-entropy
                    record.update(z_loss=report["z_loss"], loss=record["loss"] + report["z_loss"])
                window_time, window_steps = 0.0, 0
                if t.eval_iters and (state.iteration % t.eval_interval == 0 or state.iteration == t.train_iters):
                    record.update(evaluate(recipe, config, ddp, data.valid))
                records.append(record)
                logger.log(record)
            reason = stop.stop_reason()  # the same on every rank
            if background is not None:
                background.poll()  # finish the checkpoints written in the background by now
            exiting = t.exit_interval is not None and state.iteration % t.exit_interval == 0
            if c.save and not bad.consecutive and (  # never a checkpoint right after a bad step
                reason or exiting or state.iteration == t.train_iters or (c.save_interval and state.iteration % c.save_interval == 0)
            ):
                saving = time.perf_counter()
                last_checkpoint = checkpointing.save(c.save, state.iteration, model, optimizer, scheduler, vars(state),
                                                     keep_last=c.keep_last_n_checkpoints, background=background)
                saves, save_time = saves + 1, save_time + time.perf_counter() - saving
            if bad.too_many:
                if background is not None:
                    background.wait()
                write_status(c.save, "bad_steps", state.iteration, t.train_iters, last_checkpoint)
                raise bad.error(state.iteration, last_checkpoint)
            if reason or exiting:
                ending = reason or "exit_interval"
                break
        if background is not None:
            background.wait()
    finally:
        stop.close()
        logger.close()
    if saves and is_logger:
        steps, wall = state.iteration - first_step, time.perf_counter() - loop_start
        print(f"{steps} steps in {wall:.1f} s ({wall / steps:.3f} s per step), of which saving {saves} checkpoints "
              f"held up training {save_time:.1f} s" + (" (written in the background: --async-save)" if background else ""), flush=True)
    write_status(c.save, ending or "finished", state.iteration, t.train_iters, last_checkpoint, stop.signal)
    if reason and rank == 0:
        print(stop_line(stop.describe(reason), state.iteration, c.save, last_checkpoint), flush=True)
    return records


def parse_args(argv=None) -> Recipe:
    return flags.parse(argv, prog="python -m fbt_megatron.train", description=DESCRIPTION)


def main(argv=None) -> int:
    quiet_library_warnings()
    train(parse_args(argv))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def cli() -> None:
    """The ``fbt-train`` console script."""
    run_cli(main)


if __name__ == "__main__":
    cli()
