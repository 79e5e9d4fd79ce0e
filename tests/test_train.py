"""The training entry point as users run it (``python -m fbt_megatron.train``, real processes):
exact resume, one clear error line for each kind of bad input, validation at its own interval."""

import hashlib
import shutil
from pathlib import Path

import pytest
from forked import run_commands

from fbt_megatron.recipe import RecipeError
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")


def train_many(runs, corpus=None) -> list:
    """(exit code, output) of ``python -m fbt_megatron.train --recipe TINY *flags`` for each
    (log file, flags) of ``runs``, one after another (each a process of its own: tests/forked.py)."""
    data = ["--data-path", str(Path(corpus.train_prefix).parent), "--corpus", "null"] if corpus is not None else []
    commands = [(["--recipe", TINY, "--threads", "1", *data, *map(str, flags)], log, None) for log, flags in runs]
    return [(code, log.read_text()) for code, (log, _) in zip(run_commands("fbt_megatron.train", commands), runs)]


def train(log: Path, *flags, corpus=None, expect_ok=True):
    """One run of the entry point; its output goes to ``log``."""
    [(code, text)] = train_many([(log, flags)], corpus)
    if expect_ok:
        assert code == 0, text[-3000:]
    return code, text


SMALL = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1", "--fused-prefill-passes", "2",
         "--pass-phases", "[{start: 0.0, mixture: {1: 0.4, 2: 0.4, 3: 0.2}}]", "--train-iters", "8"]


@pytest.mark.slow
def test_resumed_run_logs_the_same_losses_bitwise(tmp_path, small_corpus):
    full, half = tmp_path / "full", tmp_path / "half"
    runs = train_many([(tmp_path / "full.log", [*SMALL, "--save", full]),
                       (tmp_path / "half1.log", [*SMALL, "--save", half, "--exit-interval", "4"]),
                       (tmp_path / "half2.log", [*SMALL, "--save", half, "--load", half])], corpus=small_corpus)
    assert all(code == 0 for code, _ in runs), [text[-3000:] for _, text in runs]
    assert "step      4 " in runs[1][1] and "step      5 " not in runs[1][1]  # stopped at 4; the resume did 5–8

    expected, got = read_metrics(full), read_metrics(half)
    assert [r["step"] for r in got] == list(range(1, 9))  # appended across the resume
    ks = [r["k"] for r in expected]
    assert max(ks[:4]) > 1 and max(ks[4:]) > 1, ks  # multi-pass steps on both sides of the resume
    keys = ["k", "loss", "pass_losses", "state_deltas", "lr", "grad_norm", "valid_loss_fused0", "valid_loss_fused2"]
    for e, g in zip(expected, got):
        assert {k: e.get(k) for k in keys} == {k: g.get(k) for k in keys}, (e, g)  # bitwise: == on floats
    assert got[-1]["tokens"] == 8 * 4 * 64 and got[-1]["compute_tokens"] == sum(ks) * 4 * 64
    assert sorted(p.name for p in half.iterdir() if p.name.startswith("iter_")) == ["iter_0000004", "iter_0000008"]


def tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


@pytest.mark.slow
def test_bad_inputs_stop_with_one_line_and_damage_nothing(tmp_path, small_corpus):
    run = tmp_path / "run"
    train(tmp_path / "ok.log", *SMALL, "--train-iters", "3", "--save", str(run), corpus=small_corpus)
    before = tree_hash(run)
    bad_recipe = tmp_path / "bad.yaml"
    bad_recipe.write_text("training:\n  train_iters: 5\n  dropout: 0.1\n")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "iter_0000002").mkdir()
    (broken / "iter_0000002" / "common.pt").write_bytes(b"x")
    (broken / "iter_0000002" / ".metadata").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    cases = {
        "unknown recipe key": (["--recipe", str(bad_recipe)], "unknown key training.dropout"),
        "wrong type": (["--train-iters", "ten"], "--train-iters must be an integer"),
        "missing data file": (["--data-path", "null", "--train-data-path", "[/nowhere/x_text_document]",
                               "--tokenizer-model", small_corpus.tokenizer_path],
                              "data file not found: /nowhere/x_text_document.bin"),
        "parallel sizes vs world": (["--tensor-model-parallel-size", "2"], "does not divide the world size 1"),
        "offloading without recompute": (["--offload-recompute-inputs", "true"], "offload_recompute_inputs moves"),
        "checkpoint of another model": (["--load", str(run), "--num-layers", "2", "--train-iters", "6"],
                                        "is of another model: num_layers 4 → 2"),
        "malicious checkpoint": (["--load", str(broken)], "refusing to load os.system"),
        "no such run folder": (["--load", str(tmp_path / "nope")], "no such run folder"),
        "finished run": (["--load", str(run), "--train-iters", "3"], "not before --train-iters 3"),
        "prepared --data-path without --corpus null": (["--corpus", "stdlib"], "add --corpus null"),
        "unknown flag": (["--train-iter", "3"], "unknown flag --train-iter: did you mean --train-iters?"),
        "a fault that never fires": (["--inject-fault", "crash@2:9"], "'crash@2:9': rank 9 is not in this run's world of 1 process"),
    }
    results = train_many([(tmp_path / f"bad{i}.log", [*SMALL, *flags]) for i, (flags, _) in enumerate(cases.values())],
                         corpus=small_corpus)
    for (name, (flags, message)), (code, text) in zip(cases.items(), results):
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and message in errors[0], (name, text[-2000:])
        assert "Traceback" not in text, name
    assert tree_hash(run) == before  # the run folder the bad commands pointed at is untouched


@pytest.mark.slow
def test_validation_runs_at_its_own_interval(tmp_path, small_corpus):
    """--log-interval 4 --eval-interval 6: validation after steps 6 and 12 (not only at 12, the
    first logged step at a multiple of 6); step 6 is logged for it."""
    train(tmp_path / "run.log", *SMALL, "--log-interval", "4", "--eval-interval", "6", "--train-iters", "12", "--save",
          tmp_path / "run", corpus=small_corpus)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [4, 6, 8, 12]
    assert [r["step"] for r in records if "valid_loss_fused0" in r] == [6, 12]
    assert all(len([k for k in r if k.startswith("valid_loss_fused")]) == 3 for r in records if r["step"] in (6, 12))


@pytest.mark.slow
def test_extending_a_run_says_which_learning_rate_curve_applies(tmp_path, small_corpus):
    """A finished 4-step run resumed with --train-iters 6: refused without a choice; the new curve
    (equal to an uninterrupted 6-step run's) with --override-opt-param-scheduler; the checkpoint's
    decayed curve (lr 0) with --use-checkpoint-opt-param-scheduler. A changed --lr alone likewise."""
    short, events = tmp_path / "short", tmp_path / "events"
    (_, text), _ = train_many([
        (tmp_path / "short.log", [*SMALL, "--train-iters", "4", "--save-interval", "2", "--save", short, "--tensorboard-dir", events]),
        (tmp_path / "long.log", [*SMALL, "--train-iters", "6", "--save", tmp_path / "long"]),
    ], corpus=small_corpus)
    assert "vocabulary 512" in text and "learning rate: warmup to 3.0e-03 over 2 steps, constant to step 3, linear decay" in text
    long = read_metrics(tmp_path / "long")

    extensions = {  # each resumes a copy of the short run
        "refused": ["--train-iters", "6"],
        "override": ["--train-iters", "6", "--override-opt-param-scheduler"],
        "checkpoint": ["--train-iters", "6", "--use-checkpoint-opt-param-scheduler"],
        "new_lr": ["--ckpt-step", "2", "--train-iters", "4", "--lr", "1e-3"],
    }
    for name in extensions:
        shutil.copytree(short, tmp_path / name)
    results = dict(zip(extensions, train_many(
        [(tmp_path / f"{name}.log", [*SMALL, "--load", tmp_path / name, "--save", tmp_path / name, *flags])
         for name, flags in extensions.items()], corpus=small_corpus)))

    def extend(name, expect_ok=True):
        code, text = results[name]
        assert code == 0 or not expect_ok, text[-3000:]
        return code, text, read_metrics(tmp_path / name)

    code, text, _ = extend("refused", expect_ok=False)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in text, text[-2000:]
    assert "--train-iters 4 → 6" in errors[0] and "--override-opt-param-scheduler" in errors[0], errors[0]
    assert "--use-checkpoint-opt-param-scheduler" in errors[0]

    _, text, records = extend("override")
    assert "this run's applies (--override-opt-param-scheduler)" in text
    assert [r["lr"] for r in records[4:]] == [r["lr"] for r in long[4:]] and long[4]["lr"] > 0

    _, text, records = extend("checkpoint")
    assert "then 0.0e+00 to step 6" in text and [r["lr"] for r in records[4:]] == [0.0, 0.0]

    code, text, _ = extend("new_lr", expect_ok=False)
    assert code == 2 and "--lr 0.003 → 0.001" in text, text[-2000:]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    for tag in ("lm loss", "learning-rate", "grad-norm", "iteration-time", "tokens-per-sec", "lm loss validation",
                "fbt/lm loss pass1", "fbt/passes", "fbt/compute-tokens"):
        assert tag in tags, tags


def test_a_validation_split_smaller_than_the_validation_asks_for_is_a_warning(small_corpus):
    from fbt_megatron.commands import train as entry
    from fbt_megatron.trainer.data import build_data
    from fbt_megatron.trainer.metrics import validation_note

    flags = ["--recipe", TINY, "--data-path", str(Path(small_corpus.train_prefix).parent), "--corpus", "null",
             "--seq-length", "64", "--global-batch-size", "4", "--micro-batch-size", "2", "--train-iters", "2"]
    fits = entry.parse_args([*flags, "--eval-iters", "1"])
    assert validation_note(build_data(fits, 0).valid, fits) is None
    tokens = small_corpus.tokens["valid"]
    repeats = entry.parse_args([*flags, "--eval-iters", str(tokens // 64)])
    note = validation_note(build_data(repeats, 0).valid, repeats)
    assert note == (f"warning: validation reads {tokens // 64 * 4} sequences of 64 tokens but its split holds {tokens:,} "
                    f"tokens ({(tokens - 1) // 64} distinct sequences): they repeat; use a larger validation split or "
                    f"fewer --eval-iters")


@pytest.mark.parametrize(
    "flag, value, change",
    [
        ("--lr-warmup-iters", "5", "--lr-warmup-iters 2 → 5"),
        ("--lr-wsd-decay-fraction", "0.5", "--lr-wsd-decay-fraction 0.25 → 0.5"),
        ("--lr-decay-style", "cosine", "--lr-decay-style WSD → cosine"),
        ("--min-lr", "1e-4", "--min-lr 0.0 → 0.0001"),
        ("--weight-decay", "0.1", "--weight-decay 0.01 → 0.1"),
    ],
)
def test_every_change_of_the_learning_rate_curve_on_resume_needs_a_choice(flag, value, change):
    from fbt_megatron.commands import train as entry
    from fbt_megatron.optimizers import schedule

    base = ["--recipe", TINY, "--train-iters", "8", "--lr-warmup-iters", "2", "--load", "RUN"]
    saved = {"iteration": 4, "lr_schedule": schedule.lr_schedule(entry.parse_args(base))}
    with pytest.raises(RecipeError, match=f"another learning-rate schedule \\({change}.*\\): add --override"):
        schedule.choose_schedule(entry.parse_args([*base, flag, value]), saved)
    ours, note = schedule.choose_schedule(entry.parse_args([*base, flag, value, "--override-opt-param-scheduler"]), saved)
    assert ours == schedule.lr_schedule(entry.parse_args([*base, flag, value])) and "this run's applies" in note
    theirs, note = schedule.choose_schedule(entry.parse_args([*base, flag, value, "--use-checkpoint-opt-param-scheduler"]), saved)
    assert theirs == saved["lr_schedule"] and "the checkpoint's applies" in note


def test_a_constant_learning_rate_extends_without_a_choice():
    from fbt_megatron.commands import train as entry
    from fbt_megatron.optimizers import schedule

    base = ["--recipe", TINY, "--lr-decay-style", "constant", "--load", "RUN"]
    saved = {"iteration": 8, "lr_schedule": schedule.lr_schedule(entry.parse_args([*base, "--train-iters", "8"]))}
    assert schedule.choose_schedule(entry.parse_args([*base, "--train-iters", "20"]), saved)[1] is None
