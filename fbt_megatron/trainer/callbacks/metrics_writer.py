"""The training log's writer, a callback (the first of a run's: ``registry``): each logged step's
record (``trainer.metrics.TrainingLog`` makes it) as a line on stdout (``format_record``: its UTC
time first, as Megatron-LM's iteration lines), a line of ``<save>/metrics.jsonl`` and TensorBoard
scalars (``scalars``: the tags W&B uses too); at the end the log's summary line. ``metrics.jsonl`` is
appended across resumes; records past the step a run resumes from (logged after the last checkpoint
of a crashed run) are dropped first, so the file reads as one run (``read_metrics``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from fbt_megatron.common import logs
from fbt_megatron.common.io import atomic_write
from fbt_megatron.trainer.callbacks.base import Callback
from fbt_megatron.trainer.memory import describe as describe_memory, peak
from fbt_megatron.trainer.scalars import tensorboard_scalars

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"


def read_metrics(folder) -> list:
    path = Path(folder) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class MetricsWriter(Callback):
    """The records of the logging rank (``active``) to stdout, ``<folder>/metrics.jsonl`` and
    TensorBoard, each at ``on_step_end``; at ``close`` the log's summary line."""

    def __init__(self, folder: Optional[str], active: bool = True, tensorboard: bool = True,
                 tensorboard_dir: Optional[str] = None, resume_from: int = 0):
        """``active`` False: this rank does not log. ``folder`` None: no metrics file (and no
        TensorBoard unless ``tensorboard_dir`` is given). ``resume_from``: the step the run resumes at."""
        self.active = active
        self.file = self.writer = self.last = self.state = None
        if not active:
            return
        if folder is not None:
            folder = Path(folder)
            folder.mkdir(parents=True, exist_ok=True)
            kept = [r for r in read_metrics(folder) if r["step"] <= resume_from]
            atomic_write(folder / METRICS, "".join(json.dumps(r) + "\n" for r in kept))
            self.file = open(folder / METRICS, "a")
        events = tensorboard_dir or (folder / "tensorboard" if folder is not None else None)
        if tensorboard and events is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(events), purge_step=resume_from + 1 if resume_from else None)

    def on_start(self, state) -> None:
        self.state = state  # (the loop advances this one: the step reached, at close)

    def on_step_end(self, state, record: Optional[dict]) -> None:
        if record is not None:
            self.log(record)

    def log(self, record: dict) -> None:
        if self.active:
            log.info(format_record(record), extra=logs.STAMPED)  # the line opens with the record's own time
            self.last = record
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.writer:
            for tag, value in tensorboard_scalars(record).items():
                self.writer.add_scalar(tag, value, record["step"])
            self.writer.flush()

    def close(self) -> None:
        """Ends the log with a summary line of the step reached (the run's ``TrainState``; else the
        last logged record): tokens, and equivalent-compute tokens (tokens × passes)."""
        state = self.state
        r = vars(state) if state is not None and state.tokens else self.last
        if self.active and r is not None:
            step = r.get("iteration", r.get("step"))
            log.info(f"trained to step {step}: {r['tokens']:,} tokens, {r['compute_tokens']:,} equivalent-compute tokens "
                     f"(tokens × passes, {r['compute_tokens'] / r['tokens']:.3f} passes per token)")
        if self.file:
            self.file.close()
        if self.writer:
            self.writer.close()


def format_record(r: dict) -> str:
    """A record's log line: its UTC time first (as Megatron-LM's iteration lines), then the step."""
    parts = [f"{r['time_utc']} step {r['step']:>6}", f"k {r['k']}", f"loss {r['loss']:.4f}"]
    if "z_loss" in r:
        parts.append(f"z {r['z_loss']:.2e}")
    if len(r["pass_losses"]) > 1:
        parts.append("passes " + "/".join(f"{l:.4f}" for l in r["pass_losses"]))
    if "k_share" in r:  # phase, then the share of steps so far per k
        parts.append(f"phase {r['phase']} k% " + "/".join(f"{k}:{100 * v:.0f}" for k, v in r["k_share"].items()))
    if r.get("state_deltas"):
        parts.append("|Δs| " + "/".join(f"{d:.3f}" for d in r["state_deltas"]))
    parts += [f"lr {r['lr']:.2e}", f"grad {r['grad_norm']:.3f}" if r["grad_norm"] is not None else "grad -"]
    parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    if "mfu" in r:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if peak(r) is not None:
        parts.append(describe_memory(r))
    valid = [r[k] for k in sorted(r) if k.startswith("valid_loss_fused")]
    if valid:
        parts.append("valid " + "/".join(f"{v:.4f}" for v in valid))
    return " | ".join(parts)
