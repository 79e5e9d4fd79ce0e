"""What the diagnostics share: loading runs, the validation batches training evaluates on, the
passes over one microbatch, training's averaging, and the outputs (JSON, PNG, progress bars)."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import torch


# ---------------------------------------------------------------- runs
def load(folder: str):
    """``runs.load_run(folder)`` (a missing or empty folder is a ValueError: one ``error:`` line)."""
    from fbt_megatron.inference.runs import load_run

    return load_run(str(folder))


def require_feedback(run, what: str) -> None:
    if not run.model.config.latent_feedback:
        raise ValueError(f"{what} needs a run with latent feedback; {run.folder} is a baseline (latent_feedback off)")


def state_tracking_task(run, what: str):
    """The prepared state-tracking task the run was trained on (ValueError for a language-model run)."""
    from fbt_megatron.data import state_tracking

    d = run.recipe.data
    if not (state_tracking.task_name(d.corpus) or state_tracking.is_task_folder(d.data_path)):
        raise ValueError(f"{what} needs a state-tracking run (recipes/state_tracking_*.yaml); "
                         f"{run.folder} was trained on {d.data_path}")
    return state_tracking.load_task(d.data_path)


def positive(value: Optional[int], flag: str) -> Optional[int]:
    if value is not None and value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")
    return value


# ---------------------------------------------------------------- the validation batches
@dataclass
class Selection:
    """Validation microbatches grouped as training's evaluation groups them: ``batches[i]`` is the
    list of microbatches (dicts of tokens/labels/loss_mask [b, s] and seeds) of one group."""

    batches: List[List[dict]]
    description: str

    @property
    def sequences(self) -> int:
        return sum(len(mb["tokens"]) for batch in self.batches for mb in batch)

    @property
    def microbatches(self) -> int:
        return sum(len(batch) for batch in self.batches)


def validation(run, eval_iters: Optional[int] = None, sequences: Optional[int] = None) -> Selection:
    """The run's validation sequences. ``eval_iters`` (default: the run's ``--eval-iters``): the
    global batches training's ``evaluate`` reads, averaged as it averages them, so the losses
    reproduce the ones the run logged. ``sequences``: the first ``sequences`` of them instead
    (rounded up to whole microbatches), averaged over microbatches."""
    from fbt_megatron.trainer.data import build_data
    from fbt_megatron.trainer.step import microbatches

    positive(eval_iters, "--eval-iters")
    positive(sequences, "--sequences")
    if eval_iters is not None and sequences is not None:
        raise ValueError("give --eval-iters or --sequences, not both")
    recipe = copy.deepcopy(run.recipe)
    t = recipe.training
    if sequences is not None:
        count = math.ceil(sequences / t.micro_batch_size)
        needed = math.ceil(count * t.micro_batch_size / t.global_batch_size)
    else:
        needed = eval_iters or t.eval_iters or 1
    # the run's own validation dataset (its size, hence its order, as trained) unless more is asked
    t.eval_iters = max(t.eval_iters or 1, needed)
    with contextlib.redirect_stdout(io.StringIO()):  # "corpus already prepared"
        valid = build_data(recipe, 0).valid
    groups = [list(microbatches(valid, i * t.global_batch_size, recipe, 0, 1)) for i in range(needed)]
    if sequences is None:
        return Selection(groups, f"{needed} validation batches of {t.global_batch_size} sequences "
                                 f"(micro batch {t.micro_batch_size}), as training evaluates")
    flat = [mb for group in groups for mb in group][:count]
    return Selection([[mb] for mb in flat], f"the first {count * t.micro_batch_size} validation sequences "
                                            f"({count} microbatches of {t.micro_batch_size})")


def passes(model, microbatch: dict, num_passes: int) -> Iterator[Tuple[int, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """Passes 1 … ``num_passes`` over one microbatch as training's evaluation runs them (eval mode:
    no prefix mixin, no jitter; ``fbt.run_pass``): yields (j, loss L_j, top state s^{(j)}, mean
    over tokens of (s^{(j)} − s^{(j−1)})², None for j = 1). Only the previous pass's state is kept."""
    from fbt_megatron.model.fbt import default_feedback, masked_mean, run_pass, state_delta_square

    tokens, labels, mask = microbatch["tokens"], microbatch["labels"], microbatch["loss_mask"]
    feedback = default_feedback(model, tokens, microbatch["seeds"])
    previous = None
    with torch.no_grad():
        for j in range(1, num_passes + 1):
            token_loss, top = run_pass(model, tokens, labels, j, previous, feedback)
            delta = None if previous is None else state_delta_square(top, previous)
            yield j, masked_mean(token_loss, mask).detach().float(), top, delta
            previous = top


def training_mean(per_batch: Sequence[Sequence[torch.Tensor]]) -> List[float]:
    """Training's average (``step.TrainStep.evaluate``): per group the mean over its microbatches of their
    [k] values, then the mean over groups, in the same float32 operations."""
    means = [torch.stack(list(batch)).float().mean(0).tolist() for batch in per_batch]
    return torch.tensor(means).mean(0).tolist()


# ---------------------------------------------------------------- outputs
def output_folder(path: str) -> Path:
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output {path} is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def pyplot():
    """matplotlib's pyplot on the Agg back end (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def progress(iterable=None, **kwargs):
    """A tqdm bar on a terminal (stderr), nothing otherwise."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=None, dynamic_ncols=True, leave=False, **kwargs)


def run_name(run) -> str:
    return Path(run.folder).resolve().name
