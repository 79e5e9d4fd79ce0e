"""The rehearsal's report: one row per stage (wall time, peak memory, what it wrote), the figures the
stages measured (step times, checkpoint size and save/load times, the planner against the measured
memory) and the checks (PASS/FAIL), printed as tables and written to ``rehearsal.json``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, List, Optional

from fbt_megatron.common.io import atomic_write
from fbt_megatron.launch.rehearsal import checks
from fbt_megatron.launch.rehearsal.measure import GiB, Measured

MEMORY_TOLERANCE = 0.15  # the planner's estimate (with a CPU process's terms) against the largest training process's RSS
REPORT = "rehearsal.json"


def verdict(failed: int, skipped: List[str]) -> str:
    """A report's last line: what failed, and what was not checked — a report with a skipped check
    or stage never ends in a bare "all checks passed" (``tools/gpu_check.py`` ends with it too)."""
    not_checked = f"{len(skipped)} not checked (skipped: {'; '.join(skipped)})" if skipped else ""
    if failed:
        return f"FAILED: {failed} check(s)" + (f"; {not_checked}" if skipped else "")
    return f"every check that ran passed; {not_checked}" if skipped else "all checks passed"


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).exists() else 0


class Report:
    def __init__(self, folder: Path):
        self.folder = folder
        self.stages: List[dict] = []
        self.figures: List[dict] = []
        self.checks: List[dict] = []
        self.failure: Optional[str] = None

    # ------------------------------------------------------------ rows
    def stage(self, m: Measured, output: Optional[Path] = None) -> None:
        self.stages.append(dict(stage=m.name, seconds=round(m.seconds, 1), cpu_seconds=round(m.cpu_seconds, 1),
                                max_process_rss_gib=round(m.max_process_rss / GiB, 2),
                                max_tree_pss_gib=round(m.max_tree_pss / GiB, 2), exit=m.code,
                                output_gib=round(folder_bytes(output) / GiB, 2) if output else None,
                                log=str(Path(m.log).relative_to(self.folder))))

    def time(self, name: str, fn: Callable, note: str = "") -> None:
        start = time.perf_counter()
        fn()
        self.stages.append(dict(stage=name, seconds=round(time.perf_counter() - start, 1), cpu_seconds=None, max_process_rss_gib=None,
                                max_tree_pss_gib=None, exit=0, output_gib=None, log=note))

    def skip(self, name: str, why: str) -> None:
        self.stages.append(dict(stage=name, seconds=None, cpu_seconds=None, max_process_rss_gib=None, max_tree_pss_gib=None, exit=None,
                                output_gib=None, log=f"skipped: {why}"))

    def figure(self, name: str, value: float, unit: str, note: str = "") -> None:
        self.figures.append(dict(figure=name, value=value, unit=unit, note=note))

    def check(self, name: str, value: str, ok: Optional[bool]) -> None:
        self.checks.append(dict(check=name, value=value, result="INFO" if ok is None else "PASS" if ok else "FAIL"))

    def failed(self, message: str) -> None:
        self.failure = message

    # ------------------------------------------------------------ what the stages measured
    def planner(self, plan) -> None:
        c = plan.config
        self.figure("parameters", plan.params_total, "", f"{c.num_layers} layer(s), D {c.hidden_size}, FFN {c.ffn_hidden_size}, "
                    f"heads {c.num_attention_heads}/{c.num_query_groups} of {c.kv_channels}, vocabulary {c.vocab_size:,}")

    def steps(self, train: Measured, steps: dict, plan) -> None:
        from fbt_megatron.model.flops import flops_per_token

        built, planned = checks.trained_parameters(train), plan.stages[-1].params  # the logging rank's: the last stage's
        self.check("parameters per rank: the training run's model = the planner's", f"{built:,} vs {planned:,}", built == planned)

        for step, record in sorted(steps.items()):
            k = record["k"]
            self.figure(f"step {step} (k={k}) time", round(record["iteration_time"], 2), "s",
                        f"{record.get('model_tflops_per_gpu', float('nan')):.3g} model TFLOP/s per process "
                        f"({flops_per_token(plan.config, k) / 1e9:.3g} GFLOP per token, fbt_megatron.model.flops)")
        self.memory("train", train, plan)

    def memory(self, stage: str, m: Measured, plan) -> None:
        estimate = plan.memory[plan.chosen]
        planned, measured = estimate.total, m.max_process_rss
        ratio = measured / planned
        terms = ", ".join(f"{k} {v / GiB:.2f}" for k, v in estimate.terms.items())
        self.check(f"{stage}: largest process RSS vs the planner ({plan.chosen})",
                   f"{measured / GiB:.2f} vs {planned / GiB:.2f} GiB planned ({terms}): {ratio:.2f}x; {m.peak()}",
                   abs(ratio - 1) <= MEMORY_TOLERANCE)

    def checkpoint(self, path: Path, train: Measured) -> None:
        self.figure("checkpoint size (one step, torch_dist)", round(folder_bytes(path) / GiB, 2), "GiB", str(path.name))
        self.saves("train", train)

    def saves(self, stage: str, m: Measured) -> None:
        """What a stage's saves held training up, from the line its run ends with."""
        line = next((text for _, text in m.lines if "held up training" in text), None)
        if line is not None:  # "... of which saving N checkpoints held up training X s ..."
            count = line.split("of which saving ")[1].split(" checkpoint")[0]
            blocked = float(line.split("held up training ")[1].split()[0])
            background = "background" in line
            self.figure(f"{stage}: {count} checkpoint save(s), training held up ({'async' if background else 'blocking'})",
                        blocked, "s", "the rest written in the background, the run's end waits for it" if background else "")

    def load_time(self, resumed: Measured) -> None:
        """What loading the checkpoint took, from the resumed run's own line (``…, loaded in X s``)."""
        line = next((text for _, text in resumed.lines if ", loaded in " in text), None)
        if line is not None:
            self.figure("checkpoint load (the resumed run's own timing)", float(line.split(", loaded in ")[1].split()[0]), "s")

    def export(self, folder: Path, max_shard_size: str) -> None:
        from fbt_megatron.inference.convert.to_hf import parse_size

        shards = sorted(folder.glob("model-*.safetensors"))
        index = (folder / "model.safetensors.index.json").is_file()
        dtype = json.loads((folder / "config.json").read_text()).get("dtype")
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        self.figure("export size (bfloat16 safetensors)", round(size / GiB, 2), "GiB",
                    f"{len(shards)} shards, index {'present' if index else 'absent'}, dtype {dtype}")
        sharded = size > parse_size(max_shard_size)  # then shards and an index, else one model.safetensors
        layout = len(shards) > 1 and index if sharded else (folder / "model.safetensors").is_file() and not index
        self.check(f"export: bfloat16 safetensors, {'sharded with an index' if sharded else 'one file'} at --max-shard-size "
                   f"{max_shard_size}", f"{len(shards)} shards, {dtype}", layout and dtype == "bfloat16")

    def check_losses(self, name: str, expected: dict, got: dict, tolerance: float) -> None:
        """Per-pass losses and the gradient norm of one step: equal, or within ``tolerance`` (relative)."""
        keys = lambda r: r["pass_losses"] + [r["grad_norm"]]  # noqa: E731
        d = checks.relative_difference(keys(got), keys(expected))
        losses = "/".join(f"{x:.6f}" for x in got["pass_losses"])
        self.check(name, f"{losses}, gradient norm {got['grad_norm']:.6f}; losses and gradient norm: largest relative "
                   f"difference {d:.1e}", d <= tolerance)

    # ------------------------------------------------------------ the end
    def ok(self) -> bool:
        return self.failure is None and all(c["result"] != "FAIL" for c in self.checks)

    def finish(self) -> "Report":
        print(self.table(), flush=True)
        data = dict(ok=self.ok(), failure=self.failure, stages=self.stages, figures=self.figures, checks=self.checks)
        atomic_write(self.folder / REPORT, json.dumps(data, indent=1) + "\n")
        return self

    def table(self) -> str:
        def fmt(x, unit=""):
            return "-" if x is None else f"{x}{unit}"

        rows = [("stage", "wall s", "CPU s", "peak GiB (largest process RSS / all PSS)", "output GiB", "log")]
        rows += [(s["stage"], fmt(s["seconds"]), fmt(s["cpu_seconds"]), "-" if s["max_process_rss_gib"] is None else
                  f"{s['max_process_rss_gib']} / {s['max_tree_pss_gib']}", fmt(s["output_gib"]), s["log"]) for s in self.stages]
        timed = [s for s in self.stages if s["seconds"] is not None]
        rows.append(("total", round(sum(s["seconds"] for s in timed), 1),
                     round(sum(s["cpu_seconds"] or 0 for s in timed), 1), "", "", ""))
        out = [_columns(rows), ""]
        out.append(_columns([("figure", "value", "note")] + [(f["figure"], f"{f['value']:,} {f['unit']}".strip(), f["note"])
                                                             for f in self.figures]))
        out.append("")
        out.append(_columns([("check", "value", "result")] + [(c["check"], c["value"], c["result"]) for c in self.checks]))
        if self.failure:
            out += ["", f"FAILED: {self.failure}"]
        else:
            skipped = [s["stage"] for s in self.stages if s["log"].startswith("skipped:")]
            out += ["", verdict(sum(c["result"] == "FAIL" for c in self.checks), skipped)]
        out.append(f"report: {self.folder / REPORT}")
        return "\n".join(out)


def _columns(rows) -> str:
    width = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, width)).rstrip() for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in width), *lines[1:]])
