"""Weights & Biases with Megatron-LM's flags: ``--wandb-project P [--wandb-exp-name NAME]
[--wandb-save-dir DIR]`` logs every record's scalars, under the same tags as TensorBoard
(``trainer.scalars``: per-pass losses, validation, throughput, layer norms), with the
recipe as the run's config. ``wandb`` is optional: imported only when asked for, and its absence is
one line. ``--wandb-mode offline`` (or ``WANDB_MODE=offline``) writes the run under
``--wandb-save-dir`` (default ``<save>/wandb``) without a network; ``wandb sync`` uploads it later.

An online run needs an API key (``WANDB_API_KEY``, or the netrc entry ``wandb login`` writes);
without one the run stops at start-up with one line (``recipe.wandb_check``), not at its first log. The
W&B run's id is kept in ``<save>/wandb_run_id``: a run that continues its folder (``--load`` =
``--save``: a resume, a requeued Slurm job) resumes the same W&B run (``resume="allow"``), as
OLMo-core does; any other run starts a new one and keeps its id there. W&B keeps a run's steps
increasing: steps logged again after a resume from an earlier checkpoint are dropped by W&B
(``metrics.jsonl`` has them as the resumed run logged them). A resumed run's summary gets the
Slurm job's goodput account so far (``job_goodput``)."""

from __future__ import annotations

import json
from pathlib import Path

from fbt_megatron.common.io import atomic_write
from fbt_megatron.recipe.wandb_check import require_wandb
from fbt_megatron.trainer.callbacks.base import Callback
from fbt_megatron.trainer.scalars import tensorboard_scalars

RUN_ID = "wandb_run_id"


class WandbWriter(Callback):
    """One W&B run of this process's log (the logging rank's), a callback of the loop: the run
    started (or resumed) with the loop (``on_start``), each record's TensorBoard scalars once the
    log has written it (``on_step_end``), the run finished after the log's summary line (``close``)."""

    def __init__(self, recipe):
        self.wandb, self.recipe, self.run = require_wandb(), recipe, None

    def on_start(self, state) -> None:
        g, c = self.recipe.logging, self.recipe.checkpoint
        folder = Path(g.wandb_save_dir or Path(c.save or ".") / "wandb")
        folder.mkdir(parents=True, exist_ok=True)
        name = g.wandb_exp_name or (Path(c.save).name if c.save else None)
        kept = Path(c.save) / RUN_ID if c.save else None
        continues = kept is not None and kept.is_file() and c.load is not None and Path(c.load).resolve() == Path(c.save).resolve()
        resume = dict(id=kept.read_text().strip(), resume="allow") if continues else {}
        self.run = self.wandb.init(project=g.wandb_project, name=name, dir=str(folder), config=self.recipe.to_dict(),
                                   mode=g.wandb_mode, **resume)
        if kept is not None and not continues:
            atomic_write(kept, self.run.id + "\n")
        if continues:
            self.run.summary.update(job_goodput(Path(c.save)))

    def on_step_end(self, state, record) -> None:
        if record is not None:
            self.run.log(tensorboard_scalars(record), step=record["step"])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def job_goodput(save: Path) -> dict:
    """The Slurm attempts' account so far (``<save>/jobs.jsonl``: each ended attempt's seconds per
    cause, ``launch/goodput.py``), summed, as W&B summary values ``goodput/<cause> seconds``."""
    path, total = save / "jobs.jsonl", {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        for cause, seconds in json.loads(line).get("goodput", {}).items():
            total[f"goodput/{cause} seconds"] = total.get(f"goodput/{cause} seconds", 0.0) + seconds
    return total
