"""State-tracking accuracy by position, beyond the training length, after n fused passes and under
the full recurrence.

    python -m fbt_megatron.evaluation.tasks.evaluate --recipe recipes/state_tracking_fbt.yaml --load runs/parity_fbt
        [--lengths 1 2 4] [--sequences 256] [--json results.json]

Test sequences are ``max(lengths)`` × the training length T_train long, drawn from the task's own
generator (a seed no training or validation sequence uses). Accuracy is reported per position
bucket: positions up to 1 × T_train, then (1×, 2×], (2×, 4×], … — "2×" is the accuracy on
positions the model never saw in training. The modes, all in eval mode (no prefix mixin, no jitter):

    after n fused     passes 1 … n + 1 (the validation loss's "n fused prefill passes"); the
                      baseline has only n = 0
    full recurrence   k = T passes for test length T: pass j is exact up to position j, so this is
                      the sequential recurrence (each position fed the previous position's final state)

The model and its weights come from the run folder's newest checkpoint (``runs.load_run``: the
model the checkpoint records, in one process); the recipe and flags must be the ones the run was
trained with (its model is checked against the checkpoint's; the task and the passes are theirs).
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, Iterator, List, Sequence

import torch

from fbt_megatron.common.io import atomic_write

FULL = "full recurrence"


def pass_logits(model, tokens: torch.Tensor, num_passes: int) -> Iterator[torch.Tensor]:
    """Logits [b, s, V] after each of passes 1 … ``num_passes`` over ``tokens`` [b, s], as
    ``fbt.multi_pass_loss`` runs them, in the model's current mode (eval: no mixin, no jitter)."""
    from fbt_megatron.model.fbt import default_feedback, run_pass

    feedback = default_feedback(model, tokens, [0] * len(tokens))  # the seeds only matter in training
    state = None
    for j in range(1, num_passes + 1):
        logits, state = run_pass(model, tokens, None, j, state, feedback)
        yield logits


def bucket_accuracy(per_position: Sequence[float], train_length: int, lengths: Sequence[int]) -> Dict[str, float]:
    """Mean accuracy over the positions of each bucket (m_{i−1}·T, m_i·T], m_0 = 0, named "m_i x"."""
    out, start = {}, 0
    for m in lengths:
        bucket = per_position[start : m * train_length]
        out[f"{m}x"] = sum(bucket) / len(bucket)
        start = m * train_length
    return out


def accuracy_by_position(model, tokens: torch.Tensor, labels: torch.Tensor, fused_passes: int) -> Dict[str, List[float]]:
    """{mode: accuracy at each position}, over the sequences ``tokens``/``labels`` [b, T]: after
    0 … ``fused_passes`` fused passes (0 only for a model without latent feedback) and, with latent
    feedback, the full recurrence of T passes."""
    latent = model.config.latent_feedback
    reported = range(1, (fused_passes if latent else 0) + 2)
    last = tokens.shape[1] if latent else 1
    out = {}
    model.eval()
    with torch.no_grad():
        for j, logits in enumerate(pass_logits(model, tokens, last), start=1):
            accuracy = (logits.argmax(-1) == labels).float().mean(0).tolist()
            if j in reported:
                out[f"{j - 1} fused"] = accuracy
            if latent and j == last:
                out[FULL] = accuracy
    return out


def load_trained(recipe, run_folder: str):
    """The run's model (this process alone, weights of its newest checkpoint: ``runs.load_run``)
    and its task."""
    from fbt_megatron.data.state_tracking import load_task
    from fbt_megatron.inference.runs import load_run
    from fbt_megatron.trainer.stages import checkpoint_state

    task = load_task(recipe.data.data_path)
    checkpoint_state(recipe, run_folder)  # the recipe's model, or one line saying it is not
    return load_run(run_folder).model, task


def evaluate_run(recipe, run_folder: str, lengths: Sequence[int] = (1, 2, 4), sequences: int = 256) -> dict:
    """Accuracy per mode and position bucket of the run in ``run_folder`` (see the module docstring)."""
    from fbt_megatron.data.state_tracking import SPLIT_SEEDS

    if not lengths or any(m < 1 for m in lengths) or list(lengths) != sorted(set(lengths)):
        raise ValueError(f"--lengths must be increasing multiples >= 1 of the training length, got {list(lengths)}")
    if sequences < 1:
        raise ValueError(f"--sequences must be >= 1, got {sequences}")
    if recipe.training.threads:
        torch.set_num_threads(recipe.training.threads)
    model, task = load_trained(recipe, run_folder)
    tokens, labels = task.group.sample(sequences, lengths[-1] * task.seq_length, SPLIT_SEEDS["test"])
    by_position = accuracy_by_position(model, torch.from_numpy(tokens), torch.from_numpy(labels),
                                       recipe.training.fused_prefill_passes)
    return {
        "task": task.group.name, "chance": 1 / task.group.size, "train_length": task.seq_length,
        "test_length": tokens.shape[1], "sequences": sequences,
        "accuracy": {mode: bucket_accuracy(acc, task.seq_length, lengths) for mode, acc in by_position.items()},
        "by_position": by_position,
    }


def bucket_labels(buckets: Sequence[str], train_length: int) -> List[str]:
    """Column names of the buckets ("1x", "2x", "4x" → "positions 1–32 (1x)", "33–64 (2x)", "65–128 (4x)")."""
    labels, start = [], 1
    for b in buckets:
        end = int(b[:-1]) * train_length
        labels.append(f"{'positions ' if start == 1 else ''}{start}–{end} ({b})")
        start = end + 1
    return labels


def format_table(result: dict) -> str:
    """A markdown table: one row per mode, one column per position bucket."""
    buckets = list(next(iter(result["accuracy"].values())))
    head = ["mode", *bucket_labels(buckets, result["train_length"])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, row in result["accuracy"].items():
        lines.append("| " + " | ".join([mode] + [f"{row[b]:.3f}" for b in buckets]) + " |")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    from fbt_megatron.common.cli import quiet_library_warnings
    from fbt_megatron.common.logs import setup_logging
    from fbt_megatron.recipe import flags

    setup_logging()
    quiet_library_warnings()
    parser = argparse.ArgumentParser(
        prog="python -m fbt_megatron.evaluation.tasks.evaluate", description=__doc__.splitlines()[0], allow_abbrev=False,
        epilog="Every other flag (--recipe, --load RUN, model and data overrides) is read as the training "
               "entry point reads it: give the ones the run was trained with.",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4],
                        help="position buckets, as multiples of the training length (default: 1 2 4)")
    parser.add_argument("--sequences", type=int, default=256, help="test sequences (default: 256)")
    parser.add_argument("--json", help="also write the result to this file")
    args, training_flags = parser.parse_known_args(argv)
    recipe = flags.parse(training_flags, prog=parser.prog, description=parser.description)
    if recipe.checkpoint.load is None:
        raise ValueError("--load RUN (a trained run folder) is required")
    result = evaluate_run(recipe, recipe.checkpoint.load, args.lengths, args.sequences)
    print(f"{result['task']}: trained at length {result['train_length']}, {result['sequences']} test sequences "
          f"of length {result['test_length']}; accuracy by position (chance {result['chance']:.2f})")
    print(format_table(result))
    if args.json:
        atomic_write(args.json, json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    from fbt_megatron.common.cli import run_cli

    run_cli(main)
