"""Failures of the environment end a training run with one ``error:`` line naming the folder or
file and the fix, exit code 2 (bad input: a Slurm job does not retry it), no traceback, and nothing
on disk damaged (issue 44, items 4b and 5):

* a ``--save`` folder that cannot be written is refused before the model is built: a regular file,
  a path under a regular file, a read-only file system (a read-only bind mount), a full disk (a
  full tmpfs);
* a save that fails mid-run because the disk is full (a tmpfs smaller than a checkpoint; blocking
  and ``--async-save``), or that would not fit beside the newest checkpoint (a tmpfs with room for
  one): the complete checkpoints stay as they were, the unfinished one is removed;
* a damaged compressed corpus file, read when the run prepares its corpus;
* a tool's output on a full disk (``tools/preprocess_data.py``): one line, nothing half-written;
* any other write a full or read-only file system refuses (``cli.run_cli``): one line.

Real conditions that stop root too, in real processes (``tests/forked.py``); the mounts need root
(``mount``), and their cases are skipped where it is refused, except where ``FBT_REQUIRE_MOUNTS``
is set (``.ci/run``, as root): there a refusal fails.
"""

import contextlib
import gzip
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from forked import run_commands

from fbt_megatron.trainer import checkpointing

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
SMALL = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--threads", "1", "--eval-iters", "0"]


@contextlib.contextmanager
def mounted(target: Path, *args: str, needed: bool = True):
    """``mount *args target`` for the block, yielding `target`; where mounting is refused (not root)
    the test is skipped, or with ``needed=False`` None is yielded."""
    target.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
    if run.returncode != 0:
        problem = f"mount {' '.join(args)} is refused here ({run.stderr.strip()})"
        if needed and os.environ.get("FBT_REQUIRE_MOUNTS"):  # CI runs as root: a refusal there is a failure, not a skip
            pytest.fail(f"{problem} (FBT_REQUIRE_MOUNTS is set: .ci/run runs as root)")
        if needed:
            pytest.skip(f"{problem}: needs root")
        yield None
        return
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=True)


def tmpfs(target: Path, size: str, needed: bool = True):
    return mounted(target, "-t", "tmpfs", "-o", f"size={size}", "tmpfs", needed=needed)


def fill(folder: Path) -> None:
    """Write into `folder` until its file system is full."""
    with contextlib.suppress(OSError), open(folder / "fill", "wb") as f:
        while True:
            f.write(bytes(4096))
            f.flush()


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def train(tmp_path: Path, commands: dict) -> dict:
    """{name: (exit code, stdout, stderr)} of training command lines run one after another."""
    codes = run_commands("fbt_megatron.train", [(["--recipe", TINY, *map(str, argv)], tmp_path / f"{name}.out",
                                                 tmp_path / f"{name}.err") for name, argv in commands.items()])
    return {name: (code, (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text())
            for name, code in zip(commands, codes)}


def test_an_unwritable_save_folder_is_one_line_before_the_model_is_built(tmp_path):
    """--save onto a regular file, under one (ENOTDIR), on a read-only bind mount (EROFS) and on a
    full tmpfs (ENOSPC; these two where mounting is allowed): one line each, exit code 2, before the
    model is built (no header), and every folder as it was."""
    work = tmp_path / "work"  # the logs go beside it
    file, source, readonly, full = work / "file", work / "source", work / "readonly", work / "full"
    (source / "kept").mkdir(parents=True)
    file.write_text("not a folder\n")
    with mounted(readonly, "--bind", "-o", "ro", str(source), needed=False) as ro, tmpfs(full, "64k", needed=False) as fs:
        if fs:
            fill(full)
        before = snapshot(work)
        results = train(tmp_path, {"file": ["--save", file], "under_file": ["--save", file / "run"],
                                   **({"readonly": ["--save", readonly / "run"]} if ro else {}),
                                   **({"full": ["--save", full / "run"]} if fs else {})})
        assert snapshot(work) == before
    expected = {
        "file": f"error: --save {file} is a file, not a folder: choose another --save",
        "under_file": f"error: --save {file}/run cannot be created: {file} is a file, not a folder; choose another --save",
        "readonly": f"error: --save {readonly}/run: {readonly} is on a read-only file system (EROFS): choose another --save",
        "full": f"error: --save {full}/run: the file system of {full} is full (ENOSPC): free space on it or choose "
                f"another --save",
    }
    for name, (code, out, err) in results.items():
        line = expected[name]
        assert (code, err.splitlines()) == (2, [line]), (name, code, err[-3000:])
        assert "fbt-megatron:" not in out, out  # refused before the model (the header follows it)


@pytest.mark.parametrize("size,flags", [("1m", []), ("1m", ["--async-save"]), ("6m", [])],
                         ids=["full-at-the-first-save", "full-at-the-first-async-save", "no-room-for-a-second"])
def test_a_save_the_disk_cannot_take_is_one_line_and_keeps_the_checkpoints(tmp_path, small_corpus, size, flags):
    """On a 1 MiB tmpfs the first checkpoint (4 MiB) fails mid-write with ENOSPC (written in the
    background with --async-save); on a 6 MiB one the first fits and the second is refused before
    anything is written (less room than the newest checkpoint takes). One line naming the
    checkpoint, the fix and where to resume from, exit code 2; no unfinished ``.tmp`` folder left,
    the complete checkpoint intact and tracked."""
    data = ["--data-path", Path(small_corpus.train_prefix).parent, "--corpus", "null"]
    with tmpfs(tmp_path / "disk", size) as disk:
        save = disk / "run"
        [(code, out, err)] = train(tmp_path, {"run": [*data, *SMALL, "--train-iters", 3, "--save-interval", 1,
                                                      "--save", save, *flags]}).values()
        names = sorted(p.name for p in save.iterdir())
        if size == "1m":
            assert (code, err.splitlines()) == (2, [
                f"error: checkpoint {save}/iter_0000001 not saved: the file system of {save} is full (ENOSPC): free "
                f"space on it or choose another --save; no checkpoint of this run folder is complete yet"]), err[-3000:]
            assert not [n for n in names if n.startswith("iter_")], names
        else:
            assert code == 2 and re.fullmatch(
                rf"error: checkpoint {save}/iter_0000002 not saved: the file system of {save} has 1\.\d MiB free, less "
                rf"than its newest checkpoint takes \(4\.\d MiB\): free space on it or choose another --save; --load "
                rf"{save} resumes from its newest complete checkpoint, iter_0000001\n", err), err[-3000:]
            assert [n for n in names if n.startswith("iter_")] == ["iter_0000001"], names
            assert checkpointing.damage(save / "iter_0000001", collective=False) == []
            assert checkpointing.latest_iteration(save) == 1
        assert "Traceback" not in out + err


def test_a_damaged_corpus_file_ends_the_run_in_one_line(tmp_path):
    """A training run whose corpus source is a .jsonl.gz cut short: one line naming the file, where
    it breaks off and that --skip-bad-records does not cover it; exit code 2; no corpus folder."""
    whole = gzip.compress("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(2000)).encode())
    damaged = tmp_path / "web.jsonl.gz"
    damaged.write_bytes(whole[:len(whole) // 2])
    size = len(whole) // 2
    [(code, out, err)] = train(tmp_path, {"run": ["--corpus", damaged, "--data-path", tmp_path / "corpus", *SMALL]}).values()
    assert (code, err.splitlines()) == (2, [
        f"error: {damaged}: a damaged gzip file (Compressed file ended before the end-of-stream marker was reached) "
        f"near byte {size:,} of {size:,}: replace it or leave it out of the inputs (--skip-bad-records skips bad "
        f"records of a readable file, not a damaged compressed one)"]), err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.err", "run.out", "web.jsonl.gz"]


def test_a_tool_writing_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, small_corpus):
    """tools/preprocess_data.py with its output on a 64 KiB tmpfs (the documents tokenize to more):
    the write's ENOSPC is one line naming the output and its folder, exit code 2, and no half-written
    file is left."""
    import preprocess_data
    from test_corpora import in_process

    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": f"word {i} " * 50}) + "\n" for i in range(400)))
    with tmpfs(tmp_path / "disk", "64k") as disk:
        code, out, err = in_process(preprocess_data, "--input", source, "--tokenizer", small_corpus.tokenizer_path,
                                    "--output-prefix", disk / "out", "--workers", 1)
        left = sorted(p.name for p in disk.iterdir())
    assert (code, err.splitlines()) == (2, [
        f"error: {disk}/out.bin/.idx not written: the file system of {disk} is full (ENOSPC): free space on it or "
        f"write elsewhere"]), err[-3000:]
    assert left == []


def test_any_write_the_file_system_refuses_is_one_line(tmp_path):
    """What no caller said better (a metrics or heartbeat write of a run): ``run_cli`` ends an OSError
    of a full or read-only file system in one line naming the folder (when the error names the
    file), exit code 2; other OSErrors keep their traceback."""
    from test_corpora import in_process

    source, readonly, full = tmp_path / "source", tmp_path / "readonly", tmp_path / "full"
    source.mkdir()

    class Tool:  # a command whose main writes into a folder
        def __init__(self, write):
            self.main = lambda argv: write()

    with mounted(readonly, "--bind", "-o", "ro", str(source)), tmpfs(full, "64k"):
        fill(full)
        assert in_process(Tool(lambda: (readonly / "metrics.jsonl").write_text("{}\n"))) == (
            2, "", f"error: {readonly} is on a read-only file system (EROFS): write elsewhere (writing "
                   f"{readonly}/metrics.jsonl)\n")
        assert in_process(Tool(lambda: (full / "heartbeat.json").write_bytes(bytes(8192)))) == (
            2, "", "error: the file system of a folder this command writes in is full (ENOSPC): free space on it or "
                   "write elsewhere\n")
    with pytest.raises(IsADirectoryError):
        in_process(Tool(lambda: open(tmp_path, "w")))
