"""SFT with the prompt-aware prefix mixin against the pretraining (random) one, on CPU.

From one tiny pretrained run (``--pretrained``, else ``recipes/tiny_cpu.yaml`` trained first into
``<output>/pretrain``), two SFT stages of ``recipes/sft_tiny_cpu.yaml`` with the same seed, data and
steps, ``--sft-prefix-mixin prompt`` and ``random``, run side by side (one thread each). Prints the
validation loss on assistant tokens after 0, 1, 2, 3 fused passes (validation keeps the prompt plain
in both: prompt-then-generate) as a Markdown table. Finished runs are reused.

    python tools/sft_prefix_mixin.py --pretrained runs/demo/lm/FBT-800      # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fbt_megatron.common.cli import run_cli
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

ROOT = Path(__file__).resolve().parent.parent
MODES = ("prompt", "random")


def train(log: Path, *flags) -> None:
    """One run of the training entry point (its output in ``log``); stops on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "fbt_megatron.train", "--threads", "1", *map(str, flags)],
                              cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        raise ValueError(f"the run logged in {log} failed (exit code {code}): {log.read_text()[-1500:]}")


def final_validation(run: Path) -> list:
    record = [r for r in read_metrics(run) if "valid_loss_fused0" in r][-1]
    return [record[f"valid_loss_fused{j}"] for j in range(4)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrained", type=Path, help="a tiny_cpu run folder (default: train one into <output>/pretrain)")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "sft_prefix_mixin")
    parser.add_argument("--train-iters", type=int, default=150, help="SFT steps (the recipe's: 150)")
    parser.add_argument("--seed", type=int, default=1234, help="the SFT runs' seed (data order, draws)")
    args = parser.parse_args(argv)
    pretrained = args.pretrained or args.output / "pretrain"
    if args.pretrained is None:
        train(args.output / "pretrain.log", "--recipe", ROOT / "recipes" / "tiny_cpu.yaml", "--save", pretrained, "--load", pretrained)

    def sft(mode: str) -> list:
        run = args.output / f"sft_{mode}"
        train(args.output / f"sft_{mode}.log", "--recipe", ROOT / "recipes" / "sft_tiny_cpu.yaml", "--sft-prefix-mixin", mode,
              "--pretrained-checkpoint", pretrained, "--load", run, "--save", run, "--train-iters", args.train_iters,
              "--eval-interval", args.train_iters, "--seed", args.seed)
        return final_validation(run)

    train(args.output / "prepare.log", "--recipe", ROOT / "recipes" / "sft_tiny_cpu.yaml", "--pretrained-checkpoint", pretrained,
          "--load", "null", "--save", "null", "--train-iters", 1, "--eval-iters", 0)  # the SFT set, prepared once
    with ThreadPoolExecutor(len(MODES)) as pool:
        losses = dict(zip(MODES, pool.map(sft, MODES)))
    print(f"SFT validation loss (assistant tokens) after {args.train_iters} steps of 3 passes from {pretrained}, "
          f"seed {args.seed}:\n")
    print("| prefix mixin | " + " | ".join(f"{j} fused" for j in range(4)) + " |")
    print("|---|" + "---:|" * 4)
    for mode, values in losses.items():
        print(f"| {mode} | " + " | ".join(f"{v:.4f}" for v in values) + " |")
    return 0


if __name__ == "__main__":
    run_cli(main)
