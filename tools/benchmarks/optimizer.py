"""The optimizer step (``tools/benchmark.py --optimizers``): NorMuon + Adam against Adam, as the
training entry point builds them (one process), on fixed random gradients, for the tiny preset
and a mid-size model; information only (no goal)."""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from .measure import Ratio, median_ratio, progress, settings, start, time_rounds
from .report import format_report as report

FLAG = "--optimizers"
HELP = "measure the optimizer step instead: NorMuon + Adam against Adam, tiny and mid-size model"
DEFAULTS = dict(preset="tiny", micro_batch_size=4, repeats=21, warmup=2)

SHAPES = {  # name → make_config overrides of the tiny preset
    "tiny": {},
    "mid (8 layers, hidden 512)": dict(num_layers=8, hidden_size=512, ffn_hidden_size=1536, num_attention_heads=8,
                                       num_query_groups=4, kv_channels=64),
}
OPTIMIZERS = ("normuon", "adam")
RATIOS = [Ratio(f"optimizer_step_normuon_vs_adam_{name.split()[0]}", f"optimizer step, NorMuon + Adam / Adam, {name}",
                "time", f"normuon@{name}", f"adam@{name}") for name in SHAPES]


def optimizer_step(optimizer_name: str, shape: dict, seed: int) -> Callable[[], None]:
    """One optimizer step of the training run's optimizer (``build.build_optimizer``, one
    process) on fixed random gradients, weights updated in place."""
    from fbt_megatron.recipe import flags
    from fbt_megatron.trainer.build import build_model, build_optimizer

    recipe = flags.parse(["--optimizer", optimizer_name, "--lr", "0.01", "--adam-lr", "5e-4",
                          *(f"--{k.replace('_', '-')}={v}" for k, v in shape.items())], prog="benchmark", description="")
    config, model, ddp = build_model(recipe, 2048)
    optimizer, _ = build_optimizer(recipe, config, ddp)
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=generator))
    return optimizer.step


def measure(args) -> dict:
    """Optimizer step times of every optimizer and shape, in interleaved rounds."""
    load_before = start(args)
    steps = {f"{opt}@{name}": optimizer_step(opt, shape, args.seed) for name, shape in SHAPES.items() for opt in OPTIMIZERS}
    with progress((args.warmup + args.repeats) * len(steps), "optimizer benchmark", "step") as bar:
        time_rounds(steps, args.warmup, bar)
        times = time_rounds(steps, args.repeats, bar)
    return dict(
        settings=settings(args, load_before),
        step_seconds={name: {opt: statistics.median(times[f"{opt}@{name}"]) for opt in OPTIMIZERS} for name in SHAPES},
        ratios={r.key: r.result(median_ratio(times[r.numerator], times[r.denominator])) for r in RATIOS},
    )


def format_report(results: dict) -> str:
    title = "FBT optimizer benchmark: NorMuon + Adam against Adam (one process, fixed random gradients)"
    rows = [[name, f"{1e3 * t['normuon']:.1f}", f"{1e3 * t['adam']:.1f}"] for name, t in results["step_seconds"].items()]
    return report(results, title, [("model", 28), ("NorMuon+Adam ms", 16), ("Adam ms", 9)], rows)
