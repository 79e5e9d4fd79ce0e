"""Pretraining entry point: ``python -m fbt_megatron.train --recipe recipes/NAME.yaml [overrides]``.

Runs alone (one process) or under ``torchrun``/``srun``. Overrides use Megatron-LM's argument
names (``--train-iters 200 --micro-batch-size 4 --tensor-model-parallel-size 2 --save runs/x``).
The step, top to bottom: pick k for this step (the pass schedule) → run megatron-core's
forward-backward schedule over the microbatches, each doing k passes (``parallel.pipeline``: all
passes in one forward step at PP = 1, passes as virtual pipeline chunks at PP > 1) → reduce
gradients (DDP) → optimizer step → learning-rate step → log / validate / checkpoint.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist

from fbt_megatron import checkpointing, platform
from fbt_megatron.cli import run_cli
from fbt_megatron.fbt import PassSchedule, pass_weights
from fbt_megatron.metrics import MetricsLogger
from fbt_megatron.recipe import Recipe, RecipeError, add_override_flags, apply_overrides, load_recipe


# ---------------------------------------------------------------- building blocks
def build_model(recipe: Recipe, vocab_size: int):
    """This pipeline stage's FBTModel in megatron-core DDP (gradient buffers, reduction over
    data-parallel ranks)."""
    from fbt_megatron.parallel import data as parallel_data
    from fbt_megatron.parallel import pipeline
    from fbt_megatron.config import make_config
    from fbt_megatron.model import FBTModel

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
    model = FBTModel(config, **pipeline.stage()).to(device=platform.device(), dtype=dtype)
    ddp = parallel_data.wrap(config, model, p.overlap_grad_reduce, p.use_distributed_optimizer)
    return config, model, ddp


def build_optimizer(recipe: Recipe, config, ddp):
    """megatron-core's optimizer (Adam or SGD; weight decay off for norms and 1-D parameters) and its
    WSD / cosine learning-rate scheduler."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, t = recipe.optimizer, recipe.training
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=o.optimizer,
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            sgd_momentum=o.sgd_momentum,
            clip_grad=o.clip_grad,
            bf16=o.bf16,
            fp16=o.fp16,
            loss_scale=o.loss_scale,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=recipe.parallel.use_distributed_optimizer,
        ),
        [ddp],
    )
    config.grad_scale_func = optimizer.scale_loss
    wsd = o.lr_decay_style == "WSD"
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters,
        lr_decay_steps=t.train_iters,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=t.train_iters,
        wd_incr_style="constant",
        wsd_decay_steps=round(o.lr_wsd_decay_fraction * t.train_iters) if wsd else None,
        lr_wsd_decay_style=o.lr_wsd_decay_style if wsd else None,
    )
    return optimizer, scheduler


@dataclass
class Data:
    tokenizer: object
    train: object
    valid: object
    source: str


def build_data(recipe: Recipe, world_rank: int) -> Data:
    """Tokenizer and GPTDatasets. The embedded default corpus is prepared on first use (rank 0
    prepares, the others wait)."""
    from fbt_megatron.data.corpus import ensure_corpus, load_corpus
    from fbt_megatron.data.datasets import build_datasets
    from fbt_megatron.data.tokenizer import load_tokenizer

    d, t = recipe.data, recipe.training
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
    gbs = t.global_batch_size
    train, valid, _ = build_datasets(
        tokenizer,
        seq_length=d.seq_length,
        seed=t.seed,
        num_samples=(t.train_iters * gbs, max(1, t.eval_iters) * gbs, None),
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
    context parallelism each CP rank keeps its load-balanced chunks of every sequence."""
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
            for key in ("tokens", "labels", "loss_mask")
        }
        batch["seeds"] = [sequence_seed(t.seed, i) for i in ids]
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
    for key in ("pass_losses", "state_deltas"):
        if reports and key in reports[0]:
            out[key] = torch.stack([r[key] for r in reports]).mean(0)
    return out


def data_parallel_mean(report: dict) -> dict:
    """A step's report averaged over data- and context-parallel ranks (and over the TP ranks, which
    hold shards of the sequence under SP), as floats (one host sync: log steps only)."""
    from megatron.core import parallel_state

    out = {}
    for key, value in report.items():
        value = value.clone()
        for group in (parallel_state.get_data_parallel_group(with_context_parallel=True), parallel_state.get_tensor_model_parallel_group()):
            dist.all_reduce(value, group=group)
            value /= dist.get_world_size(group)
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


def resume_state(recipe: Recipe) -> Optional[dict]:
    """The training state of the checkpoint ``--load`` resumes from (None: start from scratch),
    checked against the recipe before any work is done."""
    load, model = recipe.checkpoint.load, recipe.to_dict()["model"]
    if load is None:
        return None
    if not Path(load).is_dir():
        raise RecipeError(f"--load {load}: no such run folder")
    if checkpointing.latest_iteration(load) is None:
        print(f"--load {load}: no checkpoint yet, starting from scratch", flush=True)
        return None
    saved = checkpointing.read_train_state(load)
    if saved["model"] != model:
        raise RecipeError(f"the checkpoint in {load} is of model {saved['model']}, the recipe asks for {model}")
    if saved["iteration"] >= recipe.training.train_iters:
        raise RecipeError(
            f"the checkpoint in {load} is at iteration {saved['iteration']}, not before --train-iters {recipe.training.train_iters}"
        )
    return saved


def train(recipe: Recipe) -> List[dict]:
    """Train per the recipe; returns the logged records (also on stdout / metrics.jsonl / TensorBoard)."""
    from megatron.core import parallel_state

    t, c = recipe.training, recipe.checkpoint
    if t.threads:
        torch.set_num_threads(t.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    recipe.validate(world)
    saved = resume_state(recipe)
    p = recipe.parallel
    platform.init_distributed(
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size, t.seed, context_parallel_size=p.context_parallel_size
    )
    rank = dist.get_rank()
    data = build_data(recipe, rank)
    vocab = data.tokenizer.padded_vocab_size(recipe.parallel.tensor_model_parallel_size, recipe.data.make_vocab_size_divisible_by)
    config, model, ddp = build_model(recipe, vocab)
    optimizer, scheduler = build_optimizer(recipe, config, ddp)
    schedule = PassSchedule(t.seed, recipe.passes.passes, recipe.passes.pass_mixture, recipe.passes.pass_mixture_start)
    state = TrainState(pass_schedule=schedule.state_dict(), model=recipe.to_dict()["model"])

    if saved is not None:
        checkpointing.load(c.load, model, optimizer, scheduler)
        state = TrainState(**{**saved, "pass_schedule": state.pass_schedule})
    if c.create_seed_checkpoint:
        print(f"seed checkpoint: {checkpointing.save(c.save, state.iteration, model, None, None, vars(state))}", flush=True)
        return []

    is_logger = rank == dist.get_world_size() - 1  # last pipeline stage: it has the losses
    logger = MetricsLogger(c.save, active=is_logger, tensorboard=c.tensorboard, resume_from=state.iteration)
    if is_logger:
        print(
            f"fbt-megatron: {recipe.model.preset} ({sum(p.numel() for p in model.parameters()):,} params on this rank), "
            f"data {data.source}, world {dist.get_world_size()} (tp {recipe.parallel.tensor_model_parallel_size}, "
            f"pp {recipe.parallel.pipeline_model_parallel_size}, cp {recipe.parallel.context_parallel_size}, "
            f"dp {parallel_state.get_data_parallel_world_size()}), "
            f"steps {state.iteration}→{t.train_iters}",
            flush=True,
        )
    tokens_per_step = t.global_batch_size * recipe.data.seq_length
    records, window_time, window_tokens = [], 0.0, 0
    while state.iteration < t.train_iters:
        k = schedule(state.iteration)
        start = time.perf_counter()
        log_step = (state.iteration + 1) % t.log_interval == 0 or state.iteration + 1 == t.train_iters
        ddp.start_step(k)
        optimizer.zero_grad()
        report = run_schedule(recipe, ddp, data.train, state.consumed_samples, k, forward_only=False, measure_deltas=log_step)
        _, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        window_time += time.perf_counter() - start
        window_tokens += tokens_per_step
        state.iteration += 1
        state.consumed_samples += t.global_batch_size
        state.tokens += tokens_per_step
        state.compute_tokens += tokens_per_step * k

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
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens_per_s": window_tokens / window_time,
                "tokens": state.tokens,
                "compute_tokens": state.compute_tokens,
            }
            window_time, window_tokens = 0.0, 0
            if t.eval_iters and (state.iteration % t.eval_interval == 0 or state.iteration == t.train_iters):
                record.update(evaluate(recipe, config, ddp, data.valid))
            records.append(record)
            logger.log(record)
        exiting = t.exit_interval is not None and state.iteration % t.exit_interval == 0
        if c.save and (
            exiting or state.iteration == t.train_iters or (c.save_interval and state.iteration % c.save_interval == 0)
        ):
            checkpointing.save(c.save, state.iteration, model, optimizer, scheduler, vars(state))
        if exiting:
            break
    logger.close()
    return records


def parse_args(argv=None) -> Recipe:
    parser = argparse.ArgumentParser(
        prog="python -m fbt_megatron.train", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--recipe", help="recipe YAML (recipes/*.yaml); flags below override it")
    add_override_flags(parser)
    args = parser.parse_args(argv)
    return apply_overrides(load_recipe(args.recipe), args)


def main(argv=None) -> int:
    for category in (UserWarning, FutureWarning, DeprecationWarning):  # megatron/torch API notices
        warnings.filterwarnings("ignore", category=category, module=r"(megatron|torch)\..*")
    warnings.filterwarnings("ignore", message=".*(ShardedTensor|grad attribute of a Tensor that is not a leaf).*")
    train(parse_args(argv))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def cli() -> None:
    """The ``fbt-train`` console script."""
    run_cli(main)


if __name__ == "__main__":
    cli()
