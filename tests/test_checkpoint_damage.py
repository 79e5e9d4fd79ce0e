"""Fault injection: every kind of file in a checkpoint folder truncated, corrupted or deleted is
one error line naming the file and the older complete checkpoint (``--ckpt-step N``), which then
loads; the damaged run folder is left as it was."""

import shutil
from pathlib import Path

import pytest
import torch
from test_train import SMALL, train, train_many, tree_hash

from fbt_megatron.trainer import checkpointing
from fbt_megatron.trainer.checkpointing import CheckpointError

# Saves at 2 and 4 and stops; resuming with --train-iters 6 keeps the same learning-rate schedule.
RUN = [*SMALL, "--train-iters", "6", "--save-interval", "2", "--exit-interval", "4", "--lr-decay-style", "constant"]
NEWEST, OLDER = "iter_0000004", "iter_0000002"


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    folder = tmp_path_factory.mktemp("damage") / "run"
    train(folder.parent / "run.log", *RUN, "--save", str(folder), corpus=small_corpus)
    return folder


def copy_of(run, tmp_path, name="copy") -> Path:
    copy = tmp_path / name
    shutil.copytree(run, copy)
    return copy


def damage(file: Path, how: str) -> str:
    """Damage a file; returns the problem the message should state."""
    name, data = file.name, file.read_bytes()
    if how == "truncated":
        file.write_bytes(data[: len(data) // 2])
        return f"{name} is truncated ({len(data) // 2:,} of {len(data):,} bytes)"
    if how == "corrupted":
        middle = len(data) // 2
        file.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 16]) + data[middle + 16 :])
        return f"{name} content differs from what was saved"
    file.unlink()
    return f"{name} is missing"


def message(copy: Path, problem: str) -> str:
    return f"checkpoint {copy / NEWEST} is damaged: {problem}; {OLDER} is complete: resume from it with --ckpt-step 2"


@pytest.mark.slow
def test_each_damaged_file_is_named_with_the_older_checkpoint(run, tmp_path):
    names = sorted(p.name for p in (run / NEWEST).iterdir())
    assert {"__0_0.distcp", "common.pt", "metadata.json", ".metadata", "files.json"} <= set(names), names
    for name in names:
        for how in ("truncated", "corrupted", "deleted"):
            copy = copy_of(run, tmp_path, f"{name}-{how}")
            problem = damage(copy / NEWEST / name, how)
            if name == "files.json" and how != "deleted":  # its own hash, or no longer JSON
                problem = ("files.json is unreadable", "files.json content differs from what was saved")
            before = tree_hash(copy)
            expected = [message(copy, p) for p in (problem if isinstance(problem, tuple) else (problem,))]
            # before torch.distributed is up: sizes and the small files' hashes; the large files'
            # hashes (a corrupted .distcp) are checked by load(), on every rank
            if not (name.endswith(".distcp") and how == "corrupted"):
                with pytest.raises(CheckpointError) as e:
                    checkpointing.read_train_state(copy)
                assert str(e.value) in expected, (name, how, str(e.value))
            with pytest.raises(CheckpointError) as e:
                checkpointing.load(copy, None, None, None)  # refused before the model is touched
            assert str(e.value) in expected, (name, how, str(e.value))
            assert checkpointing.read_train_state(copy, iteration=2)["iteration"] == 2
            assert tree_hash(copy) == before, (name, how)
            shutil.rmtree(copy)
    # a manifest still valid JSON but changed (one recorded size): the manifest is blamed, not the file
    copy = copy_of(run, tmp_path)
    manifest = copy / NEWEST / "files.json"
    size = (copy / NEWEST / "common.pt").stat().st_size
    manifest.write_text(manifest.read_text().replace(f'"size": {size},', f'"size": {size + 1},'))
    with pytest.raises(CheckpointError) as e:
        checkpointing.read_train_state(copy)
    assert str(e.value) == message(copy, "files.json content differs from what was saved")


@pytest.mark.slow
def test_the_entry_point_says_it_in_one_line_and_resumes_from_the_older_one(run, tmp_path, small_corpus):
    # a size problem (found before torch.distributed starts) and a content problem (found by load),
    # then the offered older checkpoint trains on, saving over the damaged iteration 4 in the same folder
    bad = [(copy_of(run, tmp_path, how), how) for how in ("truncated", "corrupted")]
    problems = [damage(copy / NEWEST / name, how) for (copy, how), name in zip(bad, ("__0_0.distcp", "__0_1.distcp"))]
    before = [tree_hash(copy) for copy, _ in bad]
    copy = copy_of(run, tmp_path)
    damage(copy / NEWEST / "__0_0.distcp", "truncated")
    *refused, (_, text) = train_many(
        [(tmp_path / f"bad_{how}.log", [*RUN, "--exit-interval", "6", "--load", folder]) for folder, how in bad]
        + [(tmp_path / "ok.log", [*RUN, "--exit-interval", "6", "--load", copy, "--save", copy, "--ckpt-step", "2"])],
        corpus=small_corpus)
    for (code, bad_text), (folder, _), problem, hashed in zip(refused, bad, problems, before):
        errors = [line for line in bad_text.splitlines() if line.startswith("error:")]
        assert code == 2 and errors == ["error: " + message(folder, problem)], bad_text[-3000:]
        assert "Traceback" not in bad_text
        assert tree_hash(folder) == hashed
    assert "step      6" in text, text[-2000:]
    assert (copy / checkpointing.TRACKER).read_text() == "6\n"
    assert checkpointing.iterations(copy) == [2, 4, 6] and checkpointing.latest_iteration(copy) == 6
    for iteration in (4, 6):
        assert checkpointing.read_train_state(copy, iteration=iteration)["iteration"] == iteration


@pytest.mark.slow
def test_no_older_complete_checkpoint_and_a_missing_step(run, tmp_path):
    copy = copy_of(run, tmp_path)
    with pytest.raises(CheckpointError, match=r"--ckpt-step 3: no checkpoint iter_0000003 in .* \(checkpoints there: 2, 4\)$"):
        checkpointing.read_train_state(copy, iteration=3)
    damage(copy / OLDER / "common.pt", "corrupted")
    problem = damage(copy / NEWEST / "__0_0.distcp", "deleted")
    with pytest.raises(CheckpointError) as e:
        checkpointing.read_train_state(copy)
    assert str(e.value) == f"checkpoint {copy / NEWEST} is damaged: {problem}; no older complete checkpoint in {copy}"
    with pytest.raises(CheckpointError, match=r"iter_0000002 is damaged: common.pt content differs from what was saved; no older"):
        checkpointing.read_train_state(copy, iteration=2)


@pytest.mark.slow
def test_a_checkpoint_without_a_manifest_gets_structural_checks(run, tmp_path):
    """Written before there were manifests: the files and sizes the torch_dist metadata lists and
    readable common files are checked, and a damaged file is still named."""
    copy = copy_of(run, tmp_path)
    for iteration in (OLDER, NEWEST):
        (copy / iteration / "files.json").unlink()
        common = torch.load(copy / iteration / "common.pt", weights_only=True)
        del common["files_manifest"]
        torch.save(common, copy / iteration / "common.pt")
    assert checkpointing.read_train_state(copy)["iteration"] == 4
    pristine = copy_of(copy, tmp_path, "pristine")
    for name, how, problem in (
        ("__0_0.distcp", "truncated", None),
        ("__0_1.distcp", "deleted", None),
        ("metadata.json", "truncated", "metadata.json is unreadable"),
        ("common.pt", "truncated", "common.pt is unreadable"),
        (".metadata", "truncated", ".metadata is unreadable"),
    ):
        shutil.rmtree(copy)
        shutil.copytree(pristine, copy)
        stated = damage(copy / NEWEST / name, how)
        with pytest.raises(CheckpointError) as e:
            checkpointing.read_train_state(copy)
        assert str(e.value) == message(copy, problem or stated), str(e.value)


def test_unfinished_and_replaced_folders_are_never_checkpoints(tmp_path):
    for name in ("iter_0000002", "iter_0000004", "iter_0000006.tmp", "iter_0000008.old", "iter_12"):
        (tmp_path / name).mkdir()
    assert checkpointing.iterations(tmp_path) == [2, 4]
    assert checkpointing.latest_iteration(tmp_path) == 4
    (tmp_path / checkpointing.TRACKER).write_text("2\n")  # the last one saved (a run resumed with --ckpt-step 2)
    assert checkpointing.latest_iteration(tmp_path) == 2
    (tmp_path / checkpointing.TRACKER).write_text("6\n")  # names no checkpoint: the newest
    assert checkpointing.latest_iteration(tmp_path) == 4
