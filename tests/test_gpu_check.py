"""tools/gpu_check.py's report and its 2-node job (tools/gpu_checks/; docs/gpu.md#a-short-loan).

The report (``CheckReport``, shared with the rehearsal) is honest by construction: a FAIL or a SKIP
makes it not ok with a non-zero exit code and a last line that never says "all checks passed", an
exception (out of memory included) is a FAIL row, a loan part that ran out of its bound or left no
report is a FAIL, a part not run a SKIP. The 2-node job's command carries a global batch that the
preflight's ``batch_fit`` accepts on the nodes' GPU count given as an argument (N6: the recipe's 16
does not divide over DP 8)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fbt_megatron.launch.rehearsal.report import CheckReport, Report
from gpu_checks import loan, slurm_job
from gpu_checks.harness import guarded

ROOT = Path(__file__).resolve().parent.parent


def test_passed_only_when_every_check_ran_and_passed():
    report = CheckReport()
    report.check("a", "1e-6", True, "< 1e-5")
    report.info("b", "3.1e-2")
    assert report.ok() and report.exit_code() == 0 and report.verdict() == "all 1 checks passed"
    report.skip("c", "no CUDA GPU on this machine")
    assert not report.ok() and report.exit_code() == 3
    assert report.verdict().startswith("NOT ALL CHECKED: 1 not checked (c)") and "all 1 checks passed" not in report.verdict()
    report.fail("d", "2e-1", "< 1e-5")
    assert report.exit_code() == 1 and report.verdict().startswith("FAILED: 1 check(s) (d); 1 not checked (c)")
    assert [c["result"] for c in report.as_dict()["checks"]] == ["PASS", "INFO", "SKIP", "FAIL"]
    assert CheckReport().verdict().startswith("NOTHING CHECKED")


def test_out_of_memory_is_a_failed_row():
    report = CheckReport()

    def step():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    guarded(report, "fbt-1b performance", step)
    guarded(report, "after it", lambda: report.check("still runs", "ok", True))
    (failed, ran) = report.checks
    assert failed["result"] == "FAIL" and failed["value"].startswith("out of memory: OutOfMemoryError: CUDA out of memory")
    assert ran["result"] == "PASS" and report.exit_code() == 1


def test_the_rehearsal_is_not_ok_with_a_stage_it_was_asked_for_skipped(tmp_path):
    asked = Report(tmp_path)
    asked.skip_stage("vllm", "no vLLM environment")
    assert not asked.ok() and asked.exit_code() == 3
    left_out = Report(tmp_path)
    left_out.skip_stage("vllm", "--no-vllm", asked=False)
    assert left_out.ok() and left_out.stages[0]["log"] == "not asked: --no-vllm"
    failed = Report(tmp_path)
    failed.failed("stage train failed (exit 1); end of train.log:\n...", ["train", "resume"])
    assert [c["result"] for c in failed.checks] == ["FAIL", "SKIP"] and failed.exit_code() == 1
    failed.finish()
    written = json.loads((tmp_path / "rehearsal.json").read_text())
    assert not written["ok"] and written["exit_code"] == 1 and written["failure"].startswith("stage train failed")


def write_part(folder: Path, name: str, code: str, report=None, bound: int = 60) -> None:
    path = "-"
    if report is not None:
        path = str(folder / f"{name}.json")
        Path(path).write_text(json.dumps(report.as_dict()))
    with open(folder / loan.PARTS, "a") as f:
        f.write(f"{name}\t{code}\t12\t{bound}\t{path}\t\n")


def test_the_loan_report_counts_every_part(tmp_path, capsys):
    gate = CheckReport()
    gate.check("gate: CUDA GPU", "1 x H100", True, "visible")
    write_part(tmp_path, "gate", "0", gate)
    assert loan.summarize(tmp_path) == 0 and "all 1 checks passed" in capsys.readouterr().out
    skipped = CheckReport()
    skipped.skip("attention kernels: the TE backend on a window layer", "needs Transformer Engine")
    write_part(tmp_path, "kernels", "3", skipped)
    assert loan.summarize(tmp_path) == 3
    write_part(tmp_path, "main_grad", "124")  # killed at its bound: no report
    write_part(tmp_path, "rehearsal", "1")  # ended without a report
    with open(tmp_path / loan.PARTS, "a") as f:
        f.write("offload\t-\t0\t0\t-\tthe environment gate failed\n")
    assert loan.summarize(tmp_path) == 1
    rows = {c["check"]: c for c in json.loads((tmp_path / "loan.json").read_text())["checks"]}
    assert rows["kernels: attention kernels: the TE backend on a window layer"]["result"] == "SKIP"
    assert rows["gate: CUDA GPU"]["result"] == "PASS"  # a row already named after its part keeps its name
    assert rows["main_grad (part): within its bound"]["value"].startswith("ran out of its 60 s (exit 124)")
    assert rows["rehearsal (part): writes its report"]["result"] == "FAIL"
    assert rows["offload (part)"] == dict(check="offload (part)", value="not run: the environment gate failed", criterion="",
                                          result="SKIP")


def training_flags(command):
    return command[command.index("--") + 1:]


@pytest.mark.parametrize("nodes, gpus", [(2, 8), (2, 4), (3, 2)])
def test_the_two_node_command_has_a_batch_that_fits(nodes, gpus, tmp_path):
    from fbt_megatron.launch.plan.planner import batch_fit
    from fbt_megatron.recipe import flags

    command = slurm_job.job_command(nodes, gpus, tmp_path / "runs", tmp_path / "logs", ["--partition", "gpu"])
    assert command[command.index("--gpus-per-node") + 1] == str(gpus)  # the nodes' GPUs, not this machine's
    recipe = flags.parse(["--recipe", slurm_job.RECIPE, *training_flags(command)], prog="test", description="")
    world = nodes * gpus
    assert recipe.training.global_batch_size == recipe.training.micro_batch_size * world // 2
    assert batch_fit(recipe, world) is None
    recipe.validate(world, this_machine=False)
    as_before = flags.parse(["--recipe", slurm_job.RECIPE, "--tensor-model-parallel-size", "2"], prog="test", description="")
    assert (batch_fit(as_before, world) is None) == (world // 2 <= 2)  # N6: the recipe's 16 fits only DP <= 2


def test_the_preflight_accepts_the_two_node_job(tmp_path):
    """``slurm submit --dry-run``: the preflight (batch_fit, the plan, the image) on 2 x 8 GPUs, nothing queued."""
    image = tmp_path / "fbt.sqsh"
    image.write_text("")  # the preflight checks that an image file exists
    command = slurm_job.job_command(2, 8, tmp_path / "runs", tmp_path / "logs", ["--container-image", str(image)])
    split = command.index("--")
    done = subprocess.run([*command[:split], "--dry-run", *command[split:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    train_args = next(line for line in done.stdout.splitlines() if line.startswith("TRAIN_ARGS="))
    assert "--tensor-model-parallel-size 2 --sequence-parallel true --global-batch-size 64 " in train_args  # micro 8 x DP 8


def test_a_world_that_tp_does_not_divide_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="do not divide by TP 2"):
        slurm_job.job_command(1, 1, tmp_path, tmp_path, [])


def test_bad_rows_are_one_error_line():
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--rows", "kernel"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: --rows: unknown kernel")
