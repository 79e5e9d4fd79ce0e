"""One logger (``fbt_megatron.common.logs``): the package logs through ``logging`` and prints only
its product, read with ``ast`` (nothing imported); the lines keep their text, INFO on stdout and
warnings on stderr; in a job of several processes one rank says what the job does, and a record
about this process passes on every rank."""

import ast
import logging
import sys
from pathlib import Path

from fbt_megatron.common import logs

PACKAGE = Path(__file__).parent.parent / "fbt_megatron"

# module → the functions whose ``print`` is what the command is for: tables, generated text, plans,
# reports, a command's result lines (and a process's last line where the package's logging is not set up)
PRODUCT = {
    "commands/diagnostics.py": {"main"},  # the summary, the files written
    "commands/generate.py": {"main"},  # the generated text
    "commands/plan.py": {"main"},  # the plan
    "commands/slurm.py": {"run_goodput"},  # the goodput table
    "commands/studies.py": {"main"},  # the plan, the report's table
    "evaluation/__main__.py": {"main"},  # the task folder built
    "evaluation/table.py": {"write_table"},  # the model × mode table, and where it went
    "evaluation/tasks/evaluate.py": {"main"},  # the accuracy table
    "inference/serving/engine.py": {"hook"},  # a refusal's error line in a vLLM process (sys.excepthook)
    "launch/plan/planner.py": {"print_plan"},  # train --dry-run's plan
    "launch/rehearsal/hf_check.py": {"main"},  # the JSON result its parent reads
    "launch/rehearsal/report.py": {"finish"},  # the rehearsal's table
    "launch/rehearsal/vllm_check.py": {"main"},  # the JSON result its parent reads
    "launch/slurm/submit.py": {"submit_jobs"},  # the job scripts (--dry-run), the jobs submitted
    "recipe/model_table.py": {"<module>"},  # the file the generator wrote
}
# run by path under the host's python3, without the package: their lines are the job log's
SCRIPTS = {"launch/attempts.py", "launch/slurm/image_check.py"}


def prints(path: Path):
    """(line, enclosing function) of each ``print(...)`` call in ``path``."""
    found = []

    def walk(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "print":
                found.append((child.lineno, function))
            walk(child, inner)

    walk(ast.parse(path.read_text()), "<module>")
    return found


def test_the_package_prints_only_its_product():
    """Status, progress, warnings and errors go through ``logging.getLogger(__name__)``."""
    stray = [f"fbt_megatron/{name}:{line} in {function}: log it (logging.getLogger(__name__)) or, if it is the "
             f"command's product, add it to PRODUCT in {Path(__file__).name}"
             for path in sorted(PACKAGE.rglob("*.py")) if (name := path.relative_to(PACKAGE).as_posix()) not in SCRIPTS
             for line, function in prints(path) if function not in PRODUCT.get(name, ())]
    assert not stray, "\n".join(stray)


def test_the_scripts_run_by_path_import_nothing_of_the_package():
    for name in SCRIPTS:
        tree = ast.parse((PACKAGE / name).read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module] + \
                   [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m.startswith("fbt_megatron")], name


def record(**extra) -> logging.LogRecord:
    r = logging.LogRecord("fbt_megatron.test", logging.INFO, __file__, 1, "said", None, None)
    r.__dict__.update(extra)
    return r


def test_one_rank_says_what_the_job_does_and_every_rank_what_is_its_own():
    """The last rank (the pipeline stage with the losses) logs; a record marked ``EVERY_RANK`` or
    logged inside ``on_this_rank()`` passes on any rank; one process passes everything."""
    def on(rank, world):
        return logs.RankFilter(lambda: (rank, world))

    assert [on(r, 4).filter(record()) for r in range(4)] == [False, False, False, True]
    assert on(0, 1).filter(record())
    assert all(on(r, 4).filter(record(**logs.EVERY_RANK)) for r in range(4))
    with logs.on_this_rank():
        assert on(0, 4).filter(record())
    assert not on(0, 4).filter(record())


def test_the_rank_comes_from_the_process_group_else_the_environment(monkeypatch):
    assert logs.rank_and_world() == (0, 1)  # the tests' one-process group (conftest)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)  # no group: torchrun's or Slurm's environment
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert logs.rank_and_world() == (3, 4)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert logs.rank_and_world() == (0, 1)


def test_lines_keep_their_text_on_the_stream_of_the_moment(capsys, monkeypatch):
    """The message alone, one line each; INFO on stdout, WARNING and ERROR (and ``STDERR``) on
    stderr; set up twice, still one handler; on a rank that does not log, only this rank's lines."""
    logger = logs.setup_logging()
    ours = [h for h in logs.setup_logging().handlers if isinstance(h, logs._Streams)]  # (pytest adds its capture's)
    assert len(ours) == 1 and not logger.propagate
    log = logging.getLogger("fbt_megatron.some.module")
    log.info("step 1 | loss 2.0")
    log.warning("warning: skipped a.jsonl:3: malformed")
    log.error("error: no such run folder")
    log.info("tokenize: 5 documents", extra=logs.STDERR)
    log.debug("not shown")
    assert capsys.readouterr() == ("step 1 | loss 2.0\n",
                                   "warning: skipped a.jsonl:3: malformed\nerror: no such run folder\ntokenize: 5 documents\n")
    rank_filter = next(f for f in ours[0].filters if isinstance(f, logs.RankFilter))
    monkeypatch.setattr(rank_filter, "where", lambda: (0, 2))
    log.info("the job's line")
    log.info("--inject-fault crash@4:0: rank 0 dies", extra=logs.EVERY_RANK)
    assert capsys.readouterr().out == "--inject-fault crash@4:0: rank 0 dies\n"
