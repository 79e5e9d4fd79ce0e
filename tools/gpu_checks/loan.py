"""The loan's one report (``--loan-summary DIR``): ``tools/gpu_loan.sh`` runs each part as its own
process under its own time bound and writes a line per part to ``DIR/parts.tsv`` (name, exit code,
seconds, bound, its report's path, a note); this reads them with the reports the parts wrote (the
gpu_check parts' JSON, the rehearsal's ``rehearsal.json``: the same ``CheckReport``), and makes one
table: every part's rows under its name, a FAIL for a part that ran out of its bound or ended
without a report, a SKIP for a part not run (and why), each part's time against its bound. Printed,
and written to ``DIR/loan.json``; its exit code is the report's (0, 1, 3)."""

from __future__ import annotations

import json
from pathlib import Path

from fbt_megatron.launch.rehearsal.report import CheckReport

PARTS = "parts.tsv"
TIMED_OUT = ("124", "137")  # timeout's exit code, and SIGKILL's after its grace


def part_rows(report: CheckReport, line: str, folder: Path) -> None:
    name, code, seconds, bound, path, note = (line.split("\t") + [""] * 6)[:6]
    prefix = f"{name}: "
    if code == "-":
        report.skip(f"{name} (part)", note or "not run")
        return
    report.info(f"{name} (part): time", f"{seconds} s of its {bound}-s bound, exit {code}", note)
    found = path not in ("", "-") and Path(path).is_file()
    if found:
        report.extend(CheckReport.load(Path(path)).checks, prefix)
    if code in TIMED_OUT:
        report.fail(f"{name} (part): within its bound", f"ran out of its {bound} s (exit {code}); see {folder / name}.log",
                    f"<= {bound} s")
    elif not found:
        report.fail(f"{name} (part): writes its report", f"exit {code}, no report; see {folder / name}.log", "a report")
    elif code not in ("0", "1", "3"):
        report.fail(f"{name} (part): ends", f"exit {code} after its report; see {folder / name}.log", "exit 0, 1 or 3")


def summarize(folder: Path) -> int:
    report = CheckReport()
    lines = [line for line in (folder / PARTS).read_text().splitlines() if line.strip()]
    for line in lines:
        part_rows(report, line, folder)
    print(f"\n== the loan report: {len(lines)} parts ({folder / PARTS})\n")
    print(report.checks_table(width=110))
    print("\n" + report.verdict())
    (folder / "loan.json").write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    print(f"report: {folder / 'loan.json'}")
    return report.exit_code()
