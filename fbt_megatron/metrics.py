"""Training logs: one record per logged step, to stdout, TensorBoard and ``<save>/metrics.jsonl``.

``metrics.jsonl`` is appended across resumes; records past the step a run resumes from (logged
after the last checkpoint of a crashed run) are dropped first, so the file reads as one run.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Optional

METRICS = "metrics.jsonl"


def read_metrics(folder) -> list:
    path = Path(folder) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# TensorBoard tags: Megatron-LM's names where it has the quantity (its dashboards and scripts
# work unchanged), ``fbt/...`` for what only FBT has. metrics.jsonl keeps the record's keys.
TAGS = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "iteration_time": "iteration-time",
    "tokens_per_s": "tokens-per-sec",
    "tokens": "consumed-tokens",
    "k": "fbt/passes",
    "compute_tokens": "fbt/compute-tokens",
    "model_tflops_per_gpu": "throughput",  # Megatron-LM's name for model TFLOP/s per GPU
    "tokens_per_s_per_gpu": "tokens-per-sec-per-gpu",
    "mfu": "mfu",
    "phase": "fbt/pass-phase",
    "z_loss": "z-loss",
    "skipped_steps": "skipped-steps",  # steps whose update was skipped (NaN/Inf gradient norm)
}


def tensorboard_scalars(record: dict) -> dict:
    """A logged record as TensorBoard tag → value."""
    out = {}
    for key, value in record.items():
        if key == "step" or value is None:
            continue
        if key == "pass_losses":  # passes 1..k
            out.update({f"fbt/lm loss pass{j}": v for j, v in enumerate(value, start=1)})
        elif key == "state_deltas":  # ‖s^{(j)} − s^{(j−1)}‖ for passes 2..k
            out.update({f"fbt/state delta pass{j}": v for j, v in enumerate(value, start=2)})
        elif key == "k_share":  # the share of steps so far that ran k passes
            out.update({f"fbt/pass-share k{k}": v for k, v in value.items()})
        elif key.startswith("valid_loss_fused"):
            out[f"fbt/lm loss validation fused{key.removeprefix('valid_loss_fused')}"] = value
            if key == "valid_loss_fused0":  # no fused pass: the plain model's validation loss
                out["lm loss validation"], out["lm loss validation ppl"] = value, math.exp(min(value, 20.0))
        else:
            out[TAGS.get(key, key)] = value
    return out


class PassShares:
    """The pass-schedule phase of a run's latest step and the share of its steps so far that ran
    each k, counted from the pure schedule (``fbt.PassSchedule``): a resumed run logs what an
    uninterrupted one does. Counting continues from the previous call (a resumed run's first
    call counts the steps before the resume once)."""

    def __init__(self, schedule):
        self.schedule, self.counts, self.steps = schedule, Counter(), 0

    def __call__(self, steps: int) -> dict:
        """``phase`` of step ``steps`` (1-based: the one just run) and ``k_share`` {"k": fraction} over steps 1..steps."""
        self.counts.update(self.schedule(i) for i in range(self.steps, steps))
        self.steps = steps
        return {"phase": self.schedule.phase(steps - 1),
                "k_share": {str(k): n / steps for k, n in sorted(self.counts.items())}}


class MetricsLogger:
    def __init__(self, folder: Optional[str], active: bool = True, tensorboard: bool = True,
                 tensorboard_dir: Optional[str] = None, resume_from: int = 0):
        """``active`` False: this rank does not log. ``folder`` None: no metrics file (and no
        TensorBoard unless ``tensorboard_dir`` is given). ``resume_from``: the step the run resumes at."""
        self.active = active
        self.file = self.writer = self.last = None
        if not active:
            return
        if folder is not None:
            folder = Path(folder)
            folder.mkdir(parents=True, exist_ok=True)
            kept = [r for r in read_metrics(folder) if r["step"] <= resume_from]
            tmp = folder / (METRICS + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, folder / METRICS)
            self.file = open(folder / METRICS, "a")
        events = tensorboard_dir or (folder / "tensorboard" if folder is not None else None)
        if tensorboard and events is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(events), purge_step=resume_from + 1 if resume_from else None)

    def log(self, record: dict) -> None:
        if self.active:
            print(format_record(record), flush=True)
            self.last = record
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.writer:
            for tag, value in tensorboard_scalars(record).items():
                self.writer.add_scalar(tag, value, record["step"])
            self.writer.flush()

    def close(self) -> None:
        """Ends the log with a summary line: tokens, and equivalent-compute tokens (tokens × passes)."""
        if self.last is not None:
            r = self.last
            print(f"trained to step {r['step']}: {r['tokens']:,} tokens, {r['compute_tokens']:,} equivalent-compute tokens "
                  f"(tokens × passes, {r['compute_tokens'] / r['tokens']:.3f} passes per token)", flush=True)
        if self.file:
            self.file.close()
        if self.writer:
            self.writer.close()


def format_record(r: dict) -> str:
    parts = [f"step {r['step']:>6}", f"k {r['k']}", f"loss {r['loss']:.4f}"]
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
    valid = [r[k] for k in sorted(r) if k.startswith("valid_loss_fused")]
    if valid:
        parts.append("valid " + "/".join(f"{v:.4f}" for v in valid))
    return " | ".join(parts)
