"""The report of a run of checks — the rehearsal's and ``tools/gpu_check.py``'s alike — and the
rehearsal's own: one row per stage (wall time, peak memory, what it wrote), the figures the stages
measured (step times, checkpoint size and save/load times, the planner against the measured memory)
and the checks, printed as tables and written to ``rehearsal.json``.

``CheckReport`` holds rows of PASS / FAIL / SKIP / INFO, each with the value measured and the
criterion it was held to. Honest by construction: an exception is a FAIL (out of memory included),
a comparison that could not run is a SKIP with its reason, ``ok()`` is true only when every check
ran and none failed, and the last line (``verdict``) says "all N checks passed" only then. Exit
codes: 0 every check ran and passed, 1 a check failed, 3 none failed but some were not checked."""

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
PASSED, FAILED, NOT_CHECKED = 0, 1, 3  # exit codes (2 stays bad input: fbt_megatron.common.cli)


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and message, whitespace collapsed; out of memory said so."""
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    if type(error).__name__ == "OutOfMemoryError" or "out of memory" in str(error).lower():
        text = "out of memory: " + text
    return text


class CheckReport:
    """Rows of PASS / FAIL / SKIP / INFO (module docstring)."""

    def __init__(self, checks: Optional[List[dict]] = None):
        self.checks: List[dict] = list(checks or [])

    # ------------------------------------------------------------ rows
    def check(self, name: str, value: str, ok: Optional[bool], criterion: str = "") -> Optional[bool]:
        """A comparison's row: PASS or FAIL by ``ok``; ``ok`` None is INFO (a figure, no criterion)."""
        result = "INFO" if ok is None else "PASS" if ok else "FAIL"
        self.checks.append(dict(check=name, value=str(value), criterion=criterion, result=result))
        return ok

    def info(self, name: str, value: str, note: str = "") -> None:
        self.check(name, value, None, note)

    def skip(self, name: str, why: str, criterion: str = "") -> None:
        """A check that could not run, and why: the report is then not ok."""
        self.checks.append(dict(check=name, value=f"not run: {why}", criterion=criterion, result="SKIP"))

    def fail(self, name: str, why: str, criterion: str = "") -> None:
        self.check(name, why, False, criterion)

    def extend(self, rows: List[dict], prefix: str = "") -> None:
        """Another report's rows, each named with ``prefix`` unless it already is."""
        self.checks += [dict(r, check=r["check"] if r["check"].startswith(prefix) else prefix + r["check"]) for r in rows]

    # ------------------------------------------------------------ the verdict
    def count(self, result: str) -> int:
        return sum(c["result"] == result for c in self.checks)

    def ok(self) -> bool:
        """Every check ran and none failed."""
        return not self.count("FAIL") and not self.count("SKIP")

    def exit_code(self) -> int:
        return FAILED if self.count("FAIL") else NOT_CHECKED if self.count("SKIP") else PASSED

    def verdict(self) -> str:
        """The last line: what failed and what was not checked; "all N checks passed" only when every one ran."""
        failed = [c["check"] for c in self.checks if c["result"] == "FAIL"]
        skipped = [c["check"] for c in self.checks if c["result"] == "SKIP"]
        passed = self.count("PASS")
        not_checked = f"{len(skipped)} not checked ({_some(skipped)})" if skipped else ""
        if failed:
            return f"FAILED: {len(failed)} check(s) ({_some(failed)})" + (f"; {not_checked}" if skipped else "")
        if skipped:
            return f"NOT ALL CHECKED: {not_checked}; the {passed} that ran passed"
        return f"all {passed} checks passed" if passed else "NOTHING CHECKED: no check ran"

    def checks_table(self, width: Optional[int] = None) -> str:
        """The rows as a table; ``width``: cells longer than that cut with "…" (the JSON keeps them whole)."""
        def cut(text: str) -> str:
            return text if width is None or len(text) <= width else text[:width - 1] + "…"

        return _columns([("check", "value", "criterion", "result")]
                        + [(cut(c["check"]), cut(c["value"]), cut(c.get("criterion", "")), c["result"]) for c in self.checks])

    def as_dict(self) -> dict:
        return dict(ok=self.ok(), exit_code=self.exit_code(), verdict=self.verdict(), checks=self.checks)

    @classmethod
    def load(cls, path: Path) -> "CheckReport":
        return cls(json.loads(Path(path).read_text())["checks"])


def _some(names: List[str], shown: int = 6) -> str:
    """The first ``shown`` names, and how many more the table holds."""
    more = f"; … {len(names) - shown} more in the table" if len(names) > shown else ""
    return "; ".join(names[:shown]) + more


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).exists() else 0


class Report(CheckReport):
    """The rehearsal's: its checks, and the stages and figures beside them."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder
        self.stages: List[dict] = []
        self.figures: List[dict] = []
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

    def skip_stage(self, name: str, why: str, asked: bool = True) -> None:
        """A stage not run: a SKIP check when the run asked for it (the report is then not ok), else a
        stage row only (``--no-vllm``)."""
        self.stages.append(dict(stage=name, seconds=None, cpu_seconds=None, max_process_rss_gib=None, max_tree_pss_gib=None, exit=None,
                                output_gib=None, log=f"{'skipped' if asked else 'not asked'}: {why}"))
        if asked:
            self.skip(f"stage {name}", why)

    def figure(self, name: str, value: float, unit: str, note: str = "") -> None:
        self.figures.append(dict(figure=name, value=value, unit=unit, note=note))

    def failed(self, message: str, not_reached: List[str]) -> None:
        """A stage failed (``message``: which, its exit code and the end of its log): a FAIL row, and
        a SKIP row for the stages it left unrun."""
        self.failure = message
        self.fail("every stage runs", message.splitlines()[0], "exit 0")
        if not_reached:
            self.skip(f"stages {', '.join(not_reached)}", "not reached: an earlier stage failed")

    # ------------------------------------------------------------ what the stages measured
    def planner(self, plan) -> None:
        c = plan.config
        self.figure("parameters", plan.params_total, "", f"{c.num_layers} layer(s), D {c.hidden_size}, FFN {c.ffn_hidden_size}, "
                    f"heads {c.num_attention_heads}/{c.num_query_groups} of {c.kv_channels}, vocabulary {c.vocab_size:,}")

    def steps(self, train: Measured, steps: dict, plan, gpu: bool = False) -> None:
        from fbt_megatron.model.flops import flops_per_token

        built, planned = checks.trained_parameters(train), plan.stages[-1].params  # the logging rank's: the last stage's
        self.check("parameters per rank: the training run's model = the planner's", f"{built:,} vs {planned:,}", built == planned,
                   "equal")

        for step, record in sorted(steps.items()):
            k = record["k"]
            self.figure(f"step {step} (k={k}) time", round(record["iteration_time"], 2), "s",
                        f"{record.get('model_tflops_per_gpu', float('nan')):.3g} model TFLOP/s per process "
                        f"({flops_per_token(plan.config, k) / 1e9:.3g} GFLOP per token, fbt_megatron.model.flops)")
        self.memory("train", train, plan, gpu)

    def memory(self, stage: str, m: Measured, plan, gpu: bool = False) -> None:
        """The planner's estimate (CPU terms) against the stage's largest process RSS; on a GPU node the
        planner's figure is device memory, which the rehearsal does not measure: a SKIP."""
        name = f"{stage}: largest process RSS vs the planner ({plan.chosen})"
        if gpu:
            self.skip(name, "a GPU process's RSS is host memory; the planner estimates device memory, which the rehearsal "
                      "does not measure", f"within {MEMORY_TOLERANCE:.0%}")
            return
        estimate = plan.memory[plan.chosen]
        planned, measured = estimate.total, m.max_process_rss
        ratio = measured / planned
        terms = ", ".join(f"{k} {v / GiB:.2f}" for k, v in estimate.terms.items())
        self.check(name, f"{measured / GiB:.2f} vs {planned / GiB:.2f} GiB planned ({terms}): {ratio:.2f}x; {m.peak()}",
                   abs(ratio - 1) <= MEMORY_TOLERANCE, f"within {MEMORY_TOLERANCE:.0%}")

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
        single = (folder / "model.safetensors").is_file()
        layout = len(shards) > 1 and index if sharded else single and not shards and not index
        found = f"{len(shards)} shards{', an index' if index else ''}{', model.safetensors' if single else ''}"
        self.check(f"export: bfloat16 safetensors, {'sharded with an index' if sharded else 'one file'} at --max-shard-size "
                   f"{max_shard_size}", f"{found}, {dtype}", layout and dtype == "bfloat16", "as asked")

    def check_losses(self, name: str, expected: dict, got: dict, tolerance: float) -> None:
        """Per-pass losses and the gradient norm of one step: equal, or within ``tolerance`` (relative)."""
        keys = lambda r: r["pass_losses"] + [r["grad_norm"]]  # noqa: E731
        d = checks.relative_difference(keys(got), keys(expected))
        losses = "/".join(f"{x:.6f}" for x in got["pass_losses"])
        self.check(name, f"{losses}, gradient norm {got['grad_norm']:.6f}; losses and gradient norm: largest relative "
                   f"difference {d:.1e}", d <= tolerance, "bit for bit" if tolerance == 0 else f"within {tolerance:.0e} relative")

    # ------------------------------------------------------------ the end
    def finish(self) -> "Report":
        print(self.table(), flush=True)
        data = dict(self.as_dict(), failure=self.failure, stages=self.stages, figures=self.figures)
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
        out += ["", self.checks_table()]
        if self.failure:
            out += ["", f"FAILED: {self.failure}"]
        out += ["", self.verdict(), f"report: {self.folder / REPORT}"]
        return "\n".join(out)


def _columns(rows) -> str:
    width = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, width)).rstrip() for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in width), *lines[1:]])
