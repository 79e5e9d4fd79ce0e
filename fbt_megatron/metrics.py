"""Training logs: one record per logged step, to stdout, TensorBoard and ``<save>/metrics.jsonl``.

``metrics.jsonl`` is appended across resumes; records past the step a run resumes from (logged
after the last checkpoint of a crashed run) are dropped first, so the file reads as one run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

METRICS = "metrics.jsonl"


def read_metrics(folder) -> list:
    path = Path(folder) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class MetricsLogger:
    def __init__(self, folder: Optional[str], active: bool = True, tensorboard: bool = True, resume_from: int = 0):
        """``active`` False: this rank does not log. ``folder`` None: stdout only (no metrics file or
        TensorBoard). ``resume_from``: the step the run resumes at."""
        self.active = active
        self.file = self.writer = None
        if folder is None or not active:
            return
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(folder) if r["step"] <= resume_from]
        tmp = folder / (METRICS + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, folder / METRICS)
        self.file = open(folder / METRICS, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(folder / "tensorboard"), purge_step=resume_from + 1 if resume_from else None)

    def log(self, record: dict) -> None:
        if self.active:
            print(format_record(record), flush=True)
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.writer:
            step = record["step"]
            for key, value in record.items():
                if key == "step" or value is None:
                    continue
                if isinstance(value, list):  # per pass: losses of passes 1..k, deltas of passes 2..k
                    first = 1 if key == "pass_losses" else 2
                    for j, v in enumerate(value, start=first):
                        self.writer.add_scalar(f"{key}/pass{j}", v, step)
                else:
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.writer:
            self.writer.close()


def format_record(r: dict) -> str:
    parts = [f"step {r['step']:>6}", f"k {r['k']}", f"loss {r['loss']:.4f}"]
    if len(r["pass_losses"]) > 1:
        parts.append("passes " + "/".join(f"{l:.4f}" for l in r["pass_losses"]))
    if r.get("state_deltas"):
        parts.append("|Δs| " + "/".join(f"{d:.3f}" for d in r["state_deltas"]))
    parts += [f"lr {r['lr']:.2e}", f"grad {r['grad_norm']:.3f}" if r["grad_norm"] is not None else "grad -"]
    parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    valid = [r[k] for k in sorted(r) if k.startswith("valid_loss_fused")]
    if valid:
        parts.append("valid " + "/".join(f"{v:.4f}" for v in valid))
    return " | ".join(parts)
