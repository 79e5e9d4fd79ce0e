"""Worker of tests/test_optimizers.py, launched as forked ranks at one parallel layout (or called in
the test's own process for one process): NorMuon + Adam (``--optimizer normuon``) through the
training training loop ``trainer.loop.train``, several runs in one launch. It writes into ``--out``:
  full/                 an uninterrupted run of STEPS steps from the seed checkpoint (metrics.jsonl,
                        its last checkpoint)
  part/                 the same run stopped by --exit-interval EXIT, then resumed with --load
  blockwise/            (--blockwise) the uninterrupted run with --muon-tp-mode blockwise
  cross/                (--resume-from R) the run resumed from run folder R (another layout's part/
                        at step EXIT)
  schedule.json         per iteration, NorMuon's and Adam's (lr, weight decay) as the scheduler sets
                        them, their peaks, and the optimizer-state bytes each rank holds
The test writes the seed checkpoint in its own process (``create_seed``).
"""

import argparse
import json
from pathlib import Path

import torch

STEPS, EXIT = 7, 4
FLAGS = [
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(STEPS),
    "--eval-iters", "0", "--tensorboard", "false", "--corpus", "null", "--log-interval", "1", "--threads", "1",
    "--optimizer", "normuon", "--lr", "0.02", "--adam-lr", "0.005", "--weight-decay", "0.1",
    "--weight-decay-schedule", "adamc", "--lr-warmup-iters", "1", "--lr-wsd-decay-fraction", "0.5",
    "--passes", "1", "--pass-phases", "[{start: 0.5, passes: 2}]",
]


def recipe_args(corpus, *flags) -> list:
    return ["--recipe", "recipes/tiny_cpu.yaml", "--data-path", str(corpus), *FLAGS, *map(str, flags)]


def create_seed(corpus, seed_checkpoint, model_json: Path) -> None:
    """The seed checkpoint every layout starts from, and the model's arguments to read it (one process)."""
    from fbt_megatron.commands import train
    from fbt_megatron.trainer import loop

    recipe = train.parse_args(recipe_args(corpus, "--create-seed-checkpoint", "true", "--save", seed_checkpoint))
    loop.train(recipe)
    model_json.write_text(json.dumps({"vocab_size": 512, "seq_length": 64, **recipe.model_overrides}))


def schedule_and_memory(recipe) -> dict:
    """Each family's (lr, wd) per iteration from the run's own optimizer and scheduler, and the
    bytes of optimizer state (moments) this rank holds once every state is initialised."""
    import torch.distributed as dist

    from fbt_megatron import optimizers
    from fbt_megatron.optimizers import schedule
    from fbt_megatron.trainer import build

    config, model, ddp = build.build_model(recipe, 512)
    optimizer, scheduler = build.build_optimizer(recipe, config, ddp)
    normuon, adam = optimizer.chained_optimizers[0], optimizer.chained_optimizers[1]
    curve = []
    for _ in range(STEPS):
        curve.append([[g["lr"], g["weight_decay"]] for g in (normuon.param_groups[0], adam.param_groups[0])])
        scheduler.step(increment=1)
    for opt in optimizer.chained_optimizers:
        opt.init_state_fn(opt.optimizer, opt.config)
    state_bytes = [None] * dist.get_world_size()
    dist.all_gather_object(state_bytes, optimizers.state_bytes(optimizer))
    peaks = [normuon.param_groups[0]["max_lr"], adam.param_groups[0]["max_lr"]]
    return {"curve": curve, "peaks": peaks, "state_bytes": state_bytes,
            "cooldown_start": schedule.cooldown_start(schedule.lr_schedule(recipe))}


def run_layout(corpus, seed_checkpoint, out: Path, overrides=(), blockwise=False, resume_from=None) -> None:
    """The runs and schedule.json of one layout (the module docstring), in this process's world."""
    import torch.distributed as dist

    from fbt_megatron.commands import train
    from fbt_megatron.trainer import loop

    def run(*flags):
        return loop.train(train.parse_args(recipe_args(corpus, *overrides, *flags)))

    run("--load", seed_checkpoint, "--save", out / "full")
    run("--load", seed_checkpoint, "--save", out / "part", "--exit-interval", EXIT)
    run("--load", out / "part", "--save", out / "part")
    if blockwise:
        run("--load", seed_checkpoint, "--save", out / "blockwise", "--muon-tp-mode", "blockwise")
    if resume_from:
        run("--load", resume_from, "--ckpt-step", EXIT, "--save", out / "cross")
    result = schedule_and_memory(train.parse_args(recipe_args(corpus, *overrides)))
    if dist.get_rank() == dist.get_world_size() - 1:
        (out / "schedule.json").write_text(json.dumps(result))
    dist.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--seed-checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--blockwise", action="store_true")
    parser.add_argument("--resume-from")
    args, overrides = parser.parse_known_args()

    import torch.distributed as dist

    torch.set_num_threads(1)
    run_layout(args.corpus, args.seed_checkpoint, Path(args.out), overrides, args.blockwise, args.resume_from)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
