"""``fbt_megatron.common.io``: files, folders and ``.bin/.idx`` pairs written whole, and on disk.

* A file is replaced whole: a writer that fails mid-way (an error, an interrupt) leaves the old
  content and no temporary file; the file is synced, renamed, then its folder synced; its mode is an
  ordinary file's (the umask's, as ``open`` makes it), and a folder's an ordinary folder's.
* A file system that cannot sync a folder (EINVAL) is tolerated, any other failure is not.
* A folder is written whole or not at all, its files synced before the rename and its parent after;
  with ``replace`` an existing folder is kept until the new one replaces it.
* A crash while a corpus split's ``.bin/.idx`` pair is published (a forked process that dies without
  cleaning up, as a killed one), before or after the new ``.bin`` is in place, leaves a corpus the
  loader refuses, never a ``.bin`` beside another's ``.idx``; preparing the split again completes it.
"""

import errno
import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from fbt_megatron.common.folders import current_umask
from fbt_megatron.common.io import FolderExists, append_synced, atomic_folder, atomic_open, atomic_write
from fbt_megatron.data import shards
from fbt_megatron.data.corpus import load_corpus
from fbt_megatron.data.preprocess import preprocess

CRASHED = 17  # the exit code of a child process that died publishing


@pytest.fixture
def synced(monkeypatch):
    """(path, inode) of what ``os.fsync`` is called on, in order: a file under the name it had then."""
    calls, fsync = [], os.fsync

    def record(fd):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_ino))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    return calls


def test_a_file_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "state.json"
    atomic_write(path, "old\n")
    for interruption in (RuntimeError("injected"), KeyboardInterrupt()):
        with pytest.raises(type(interruption)):
            with atomic_open(path) as f:
                f.write("new, half written")
                f.flush()
                raise interruption
        assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["state.json"]
    atomic_write(path, b"\x00new")
    assert path.read_bytes() == b"\x00new" and os.listdir(tmp_path) == ["state.json"]
    with pytest.raises(ValueError, match="mode 'w' or 'wb', not 'a'"):
        with atomic_open(path, "a"):
            pass


def test_the_file_is_synced_then_its_folder(tmp_path, synced):
    folder, path = tmp_path.resolve(), tmp_path / "state.json"
    atomic_write(path, "new\n")
    (file, inode), (after, _) = synced
    assert Path(file).parent == folder and re.fullmatch(r"\.state\.json\.tmp-[0-9a-f]{16}", Path(file).name)
    assert inode == path.stat().st_ino  # the file synced is the one renamed onto the path
    assert after == str(folder)  # then the rename

    synced.clear()
    append_synced(tmp_path / "fired.jsonl", "one\n")
    append_synced(tmp_path / "fired.jsonl", "two\n")
    assert (tmp_path / "fired.jsonl").read_text() == "one\ntwo\n"
    assert [p for p, _ in synced] == [str(folder / "fired.jsonl"), str(folder)] * 2


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_and_folders_are_ordinary_ones(tmp_path, umask):
    before = os.umask(umask)
    try:
        atomic_write(tmp_path / "whole", "x")
        (tmp_path / "plain").write_text("x")  # what the writers made before
        with atomic_folder(tmp_path / "folder"):
            pass
    finally:
        os.umask(before)
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert mode == {"whole": 0o666 & ~umask, "plain": 0o666 & ~umask, "folder": 0o777 & ~umask}


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EIO])
def test_a_folder_the_file_system_cannot_sync(tmp_path, monkeypatch, code):
    """EINVAL (a file system that syncs no folder) is tolerated; any other failure is an error."""
    fsync = os.fsync

    def folders_refused(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", folders_refused)
    if code == errno.EINVAL:
        atomic_write(tmp_path / "state.json", "new\n")
    else:
        with pytest.raises(OSError, match=os.strerror(code)):
            atomic_write(tmp_path / "state.json", "new\n")
    assert (tmp_path / "state.json").read_text() == "new\n"  # renamed before the folder's sync


def test_a_folder_is_written_whole_or_not_at_all(tmp_path):
    """``atomic_folder``, which every folder writer uses (corpus, task, SFT set, to-hf, from-hf,
    a study's subsets and records): a failure leaves nothing, not even the parents it made; an empty
    folder is replaced; a folder filled meanwhile by someone else is kept as it is and refused."""
    with pytest.raises(RuntimeError, match="injected"):
        with atomic_folder(tmp_path / "new" / "parents" / "out") as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("injected")
    assert list(tmp_path.iterdir()) == []

    (tmp_path / "empty").mkdir()
    with atomic_folder(tmp_path / "empty") as tmp:
        assert set(tmp_path.iterdir()) == {tmp_path / "empty", tmp} and tmp.name.startswith(".empty.tmp-")
        (tmp / "done.txt").write_text("mine")
    assert [(p.name, p.read_text()) for p in (tmp_path / "empty").iterdir()] == [("done.txt", "mine")]
    assert oct((tmp_path / "empty").stat().st_mode & 0o777) == oct(0o777 & ~current_umask())  # not mkdtemp's 0o700

    with pytest.raises(FolderExists, match="exists and is not empty"):
        with atomic_folder(tmp_path / "raced") as tmp:
            (tmp / "ours.txt").write_text("ours")
            (tmp_path / "raced").mkdir()
            (tmp_path / "raced" / "theirs.txt").write_text("theirs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "raced"]
    assert [p.name for p in (tmp_path / "raced").iterdir()] == ["theirs.txt"]


def test_a_folder_is_synced_before_and_after_its_rename(tmp_path, synced):
    with atomic_folder(tmp_path / "new" / "out") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "done.txt").write_text("mine")
    paths = [p for p, _ in synced]
    inside = Path(tmp_path.resolve(), "new", tmp.name)
    assert set(paths[:3]) == {str(inside / "sub" / "done.txt"), str(inside / "sub"), str(inside)}  # before the rename
    assert paths[3:] == [str(tmp_path.resolve() / "new"), str(tmp_path.resolve())]  # the rename, the new parent


def test_a_folder_replaced_whole(tmp_path):
    out = tmp_path / "records"

    def files():
        return {p.name: p.read_text() for p in out.iterdir()}

    with atomic_folder(out, replace=True) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError, match="injected"):
        with atomic_folder(out, replace=True) as tmp:
            (tmp / "b").write_text("2")
            raise RuntimeError("injected")
    assert files() == {"a": "1"} and os.listdir(tmp_path) == ["records"]
    with atomic_folder(out, replace=True) as tmp:
        (tmp / "b").write_text("2")
    assert files() == {"b": "2"} and os.listdir(tmp_path) == ["records"]


def crashed(function, suffix: str) -> int:
    """The exit code of ``function()`` run in a forked process that dies (``os._exit``: no clean-up,
    as a killed process) when it renames a file onto a name ending in ``suffix``."""
    pid = os.fork()
    if pid == 0:
        code, replace = 1, os.replace

        def crash(src, dst):
            if str(dst).endswith(suffix):
                os._exit(CRASHED)
            replace(src, dst)

        try:
            os.replace = crash
            function()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.parametrize("dies_at", [".bin", ".idx"])
def test_a_crash_publishing_a_split_leaves_no_corpus_the_loader_takes(small_corpus, tmp_path, dies_at):
    """Over a complete corpus, its train split tokenized again from other documents: the process
    dies as the new .bin takes its name, or after that, as the new .idx takes its name. The old .idx
    went first, so the loader (``load_corpus``, and a shard's ``complete``) refuses the corpus
    instead of reading a .bin through another's index; preparing the split again completes it."""
    folder = tmp_path / "corpus"
    shutil.copytree(os.path.dirname(small_corpus.train_prefix), folder)
    prefix = str(folder / os.path.basename(small_corpus.train_prefix))
    old = Path(prefix + ".bin").read_bytes()
    documents = tmp_path / "new.jsonl"
    documents.write_text("".join(json.dumps({"text": f"def f{i}():\n    return {i}\n"}) + "\n" for i in range(5)))

    def tokenize():
        return preprocess([str(documents)], small_corpus.tokenizer_path, prefix, show_progress=False)

    assert crashed(tokenize, dies_at) == CRASHED
    with pytest.raises(ValueError, match=r"is an incomplete corpus \(missing train_text_document.idx\)"):
        load_corpus(str(folder))
    assert not shards.complete(prefix)
    assert (Path(prefix + ".bin").read_bytes() == old) == (dies_at == ".bin")  # the old .bin or the new, alone

    assert tokenize()["documents"] == 5
    assert load_corpus(str(folder)).train_prefix == prefix and shards.complete(prefix)
    assert len(IndexedDataset(prefix)) == 5
