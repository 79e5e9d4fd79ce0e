"""Stages (``fbt_megatron/trainer/stages.py``) as users run them, in real processes: a run started from
another run's weights at another parallel layout (TP 2 × PP 2 → one process and the reverse),
--finetune, --no-load-optim, refusing another shape, and the tiny long-context stage with a
requeue-style resume.

What the weights-only starts are compared with, independently of ``stages``: a one-process run
from a seed checkpoint (weights only, iteration 0, fresh optimizer: the seed path that layout
comparisons already use) written here from the TP 2 × PP 2 source's weights as ``runs.load_run``
loads them; and, for one process → TP 2 × PP 2, the same start in one process (--finetune; layouts
agree to the equivalence matrix's tolerance)."""

from pathlib import Path

import pytest
from forked import run_commands
from helpers import launch

from fbt_megatron.trainer import checkpointing
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

ROOT = Path(__file__).parent.parent
TINY, LONGCTX = ROOT / "recipes" / "tiny_cpu.yaml", ROOT / "recipes" / "longctx_tiny_cpu.yaml"
COMMON = ["--threads", "1", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
          "--eval-interval", "2", "--eval-iters", "1", "--fused-prefill-passes", "1", "--tensorboard", "false"]
# 128 tokens (the long-context stage's source length); k = 1, 2, 3 in the first three steps of 3 or 4
SMALL = ["--recipe", TINY, *COMMON, "--seq-length", "128", "--lr-warmup-iters", "1", "--passes", "1",
         "--pass-phases", "[{start: 0.3, passes: 2}, {start: 0.6, passes: 3}]"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
REFUSED = ("layers", "vocab", "finetune_alone")
KEYS = ["step", "k", "loss", "pass_losses", "state_deltas", "lr", "grad_norm", "valid_loss_fused0", "valid_loss_fused1"]


def records(folder: Path) -> list:
    return [{k: r.get(k) for k in KEYS} for r in read_metrics(folder)]


def worst_difference(expected: list, got: list) -> float:
    """Largest relative difference of the logged losses, grad norms and validation losses."""
    assert [(r["step"], r["k"]) for r in expected] == [(r["step"], r["k"]) for r in got]
    pairs = [(e[key], g[key]) for e, g in zip(expected, got) for key in ("loss", "grad_norm", "valid_loss_fused0")
             if e[key] is not None]
    pairs += [(a, b) for e, g in zip(expected, got) for a, b in zip(e["pass_losses"], g["pass_losses"])]
    return max(abs(a - b) / abs(a) for a, b in pairs)


def write_seed(source: Path, seed: Path) -> None:
    """A weights-only checkpoint (iteration 0) of ``source``'s latest weights, as one process loads them."""
    from fbt_megatron.inference.runs import load_run

    run = load_run(str(source))
    saved = checkpointing.read_train_state(source)
    fresh = {**saved, "iteration": 0, "consumed_samples": 0, "tokens": 0, "compute_tokens": 0}
    checkpointing.save(seed, 0, run.model, None, None, fresh)


class Stages:
    """Every run of this module: one launch of forked ranks (TP 2 × PP 2) and two batches of forked
    one-process runs."""

    def __init__(self, root: Path, corpus):
        self.root, self.log = root, {}
        data = ["--data-path", str(Path(corpus.train_prefix).parent), "--corpus", "null"]
        r = self.path
        longctx = ["--recipe", LONGCTX, *COMMON, "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4",
                   "--eval-interval", "4", "--pretrained-checkpoint", r("source")]
        first = {
            # the one-process source: full checkpoints (weights, Adam state, RNG) at steps 2 and 4
            "source": [*SMALL, "--train-iters", "4", "--save-interval", "2", "--save", r("source")],
            # the same start from it in one process, with --finetune
            "single": [*SMALL, "--train-iters", "3", "--finetune", "--load", r("source"), "--save", r("single")],
            # the source resumed from step 2 without its optimizer state
            "no_optim": [*SMALL, "--train-iters", "4", "--load", r("source"), "--ckpt-step", "2", "--save", r("no_optim"),
                         "--no-load-optim"],
            # other shapes
            "layers": [*SMALL, "--train-iters", "3", "--pretrained-checkpoint", r("source"), "--save", r("layers"), "--num-layers", "2"],
            "vocab": [*SMALL, "--train-iters", "3", "--pretrained-checkpoint", r("source"), "--save", r("vocab"),
                      "--make-vocab-size-divisible-by", "384"],
            "finetune_alone": [*SMALL, "--train-iters", "3", "--finetune", "--save", r("finetune_alone")],
            # the long-context stage 128 → 512 (checkpoints at steps 2 and 4), and the same command line
            # resumed from the stage's own checkpoint of step 2 (as a job requeued then would)
            "longctx": [*longctx, "--load", r("longctx"), "--save", r("longctx"), "--save-interval", "2"],
            "longctx_again": [*longctx, "--load", r("longctx"), "--ckpt-step", "2", "--save", r("longctx_again")],
        }
        self.codes = self.forked(first, data)
        assert all(self.codes[name] == 0 for name in first if name not in REFUSED), self.failed()
        code, text = launch(root / "tp2_pp2.log", "-m", "fbt_megatron.train", *SMALL, *data, *TP2_PP2, "--train-iters", "3",
                            "--pretrained-checkpoint", r("source"), "--save", r("tp2_pp2"), nproc=4)
        assert code == 0, text[-4000:]
        self.log["tp2_pp2"] = text
        write_seed(r("tp2_pp2"), r("seed"))
        second = {
            "from_tp2_pp2": [*SMALL, "--train-iters", "3", "--pretrained-checkpoint", r("tp2_pp2"), "--save", r("from_tp2_pp2")],
            "from_seed": [*SMALL, "--train-iters", "3", "--load", r("seed"), "--save", r("from_seed")],
        }
        self.codes.update(self.forked(second, data))
        assert all(self.codes[name] == 0 for name in second), self.failed()

    def path(self, name: str) -> Path:
        return self.root / name

    def forked(self, runs: dict, data: list) -> dict:
        commands = [([*map(str, flags), *data], self.root / f"{name}.log", None) for name, flags in runs.items()]
        codes = run_commands("fbt_megatron.train", commands)
        self.log.update({name: (self.root / f"{name}.log").read_text() for name in runs})
        return dict(zip(runs, codes))

    def failed(self) -> str:
        return "\n".join(f"{n}: {self.log[n][-2000:]}" for n, c in self.codes.items() if c and n not in REFUSED)


@pytest.fixture(scope="module")
def stages(small_corpus, tmp_path_factory):
    return Stages(tmp_path_factory.mktemp("stages"), small_corpus)


@pytest.mark.slow
def test_weights_from_tp2_pp2_start_a_one_process_stage(stages):
    """TP 2 × PP 2 → one process: logs equal, bit for bit, a one-process run from a seed checkpoint
    of the source's weights (iteration 0, fresh optimizer, this run's schedule)."""
    got, expected = records(stages.path("from_tp2_pp2")), records(stages.path("from_seed"))
    assert [(r["step"], r["k"]) for r in got] == [(1, 1), (2, 2), (3, 3)]
    assert got == expected
    text = stages.log["from_tp2_pp2"]
    assert f"--pretrained-checkpoint {stages.path('tp2_pp2')}: the weights of iter_0000003 (step 3)" in text
    assert "since that checkpoint" not in text  # the same model and sequence length: nothing to report


@pytest.mark.slow
def test_weights_from_one_process_start_a_tp2_pp2_stage(stages):
    """One process → TP 2 × PP 2 (--pretrained-checkpoint): the same run as --finetune from the
    same checkpoint in one process, to the layouts' tolerance."""
    single = records(stages.path("single"))
    worst = worst_difference(single, records(stages.path("tp2_pp2")))
    print(f"stage from a one-process checkpoint at TP 2 × PP 2 vs one process: worst relative difference {worst:.1e}")
    assert worst <= 1e-5
    assert [r["step"] for r in single] == [1, 2, 3]
    # a fresh start differs: the weights did come from the source
    source = records(stages.path("source"))
    assert single[0]["loss"] < source[0]["loss"] - 0.01, (single[0], source[0])
    assert f"--finetune --load {stages.path('source')}: the weights of iter_0000004 (step 4)" in stages.log["single"]
    assert f"--pretrained-checkpoint {stages.path('source')}: the weights of iter_0000004 (step 4)" in stages.log["tp2_pp2"]


@pytest.mark.slow
def test_no_load_optim_resumes_weights_and_schedule_with_fresh_moments(stages):
    resumed, fresh = records(stages.path("source"))[2:], records(stages.path("no_optim"))
    assert [r["step"] for r in resumed] == [r["step"] for r in fresh] == [3, 4]
    assert resumed[0]["loss"] == fresh[0]["loss"] and [r["lr"] for r in resumed] == [r["lr"] for r in fresh]
    assert resumed[1]["loss"] != fresh[1]["loss"]  # step 3's update used other moments


@pytest.mark.slow
@pytest.mark.parametrize("name,message", [
    ("layers", "--pretrained-checkpoint {source} holds a model of another shape: num_layers 4 → 2 (checkpoint → this run)"),
    ("vocab", "--pretrained-checkpoint {source} holds a model of another shape: vocabulary (padded) 512 → 768"),
    ("finetune_alone", "--finetune starts from the weights of --load's checkpoint: give --load RUN"),
])
def test_another_shape_or_a_finetune_without_load_is_one_line(stages, name, message):
    text = stages.log[name]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert stages.codes[name] == 2 and len(errors) == 1 and "Traceback" not in text, text[-2000:]
    assert message.format(source=stages.path("source")) in errors[0]
    assert not stages.path(name).exists()  # nothing written


@pytest.mark.slow
def test_long_context_stage_reports_the_changes_and_a_requeued_job_resumes_the_stage(stages):
    first, again = stages.log["longctx"], stages.log["longctx_again"]
    report = "since that checkpoint: rotary_base 10000.0 → 500000.0, recompute_passes False → True, seq_length 128 → 512"
    assert report in first and "steps 0→4 of 2 × 512 tokens" in first
    # --pretrained-checkpoint is still given, but --load holds the stage's checkpoint: the stage resumes
    assert "--pretrained-checkpoint" not in again and "steps 2→4 of 2 × 512 tokens" in again
    stage, resumed = records(stages.path("longctx")), records(stages.path("longctx_again"))
    assert [(r["step"], r["k"]) for r in stage] == [(1, 3), (2, 3), (3, 3), (4, 3)]
    assert resumed == stage[2:]  # it continues exactly


@pytest.mark.slow
def test_no_load_rng_keeps_this_runs_random_streams(stages):
    """checkpointing.load restores the RNG streams saved with a checkpoint, unless asked not to."""
    import torch

    from fbt_megatron.recipe import recipe_from_dict
    from fbt_megatron.trainer.build import build_model, build_optimizer

    source = stages.path("source")
    saved = checkpointing.read_train_state(source, iteration=2)
    recipe = recipe_from_dict(saved["recipe"])
    config, model, ddp = build_model(recipe, saved["vocab_size"])
    optimizer, scheduler = build_optimizer(recipe, config, ddp)
    torch.manual_seed(0)
    ours = torch.get_rng_state()
    checkpointing.load(source, model, optimizer, scheduler, iteration=2, load_rng=False)
    assert torch.equal(torch.get_rng_state(), ours)
    checkpointing.load(source, model, optimizer, scheduler, iteration=2)
    assert not torch.equal(torch.get_rng_state(), ours)


def test_a_checkpoint_moves_between_a_cpu_and_a_gpu_with_the_rng_streams_that_map(tmp_path, monkeypatch, capsys):
    """A GPU's RNG states are 16 bytes (CUDA's generator, megatron's tracker streams: Philox), a
    CPU's 5056 (Mersenne twister), so a checkpoint's RNG vector is as long as the device that saved
    it made it; loading one of another length failed in dist-checkpointing's global-shape check
    ("does not fit this model"). Both ways through the real save and load, a GPU's streams stood in
    (``_rng_streams``): the default generator is restored exactly, the device's streams stay as
    the run seeded them, one line says which; also from a checkpoint written before the streams
    were named with it (no ``rng_parts``: its vector's length is read from the metadata)."""
    import torch

    from fbt_megatron.commands import train
    from fbt_megatron.trainer import build

    recipe = train.parse_args(["--recipe", str(TINY), "--seq-length", "32", "--num-layers", "2"])
    config, model, ddp = build.build_model(recipe, 256)
    optimizer, scheduler = build.build_optimizer(recipe, config, ddp)
    for p in model.parameters():
        p.main_grad.zero_()
    optimizer.step()  # the optimizer's state exists once it has stepped
    from fbt_megatron.trainer.checkpointing import state as held, writing

    cpu_streams, state = held._rng_streams, held._state
    gpu = [("cuda", torch.arange(16, dtype=torch.uint8)), *((name, torch.full((16,), 7, dtype=torch.uint8))
                                                            for name, _ in cpu_streams()[1:])]
    as_on_a_gpu = lambda: [cpu_streams()[0], *gpu]  # noqa: E731
    unnamed = lambda *args, **kwargs: {k: v for k, v in state(*args, **kwargs).items() if k != "rng_parts"}  # noqa: E731

    def move(folder, saving, loading, old=False) -> str:
        """Save on one device, load on the other: the warning line (the default generator restored)."""
        torch.manual_seed(5)
        expected = torch.get_rng_state()
        with monkeypatch.context() as m:
            m.setattr(held, "_rng_streams", saving)
            if old:
                m.setattr(writing, "_state", unnamed)
            checkpointing.save(tmp_path / folder, 1, model, optimizer, scheduler, vars(checkpointing.TrainState()))
        torch.manual_seed(99)
        capsys.readouterr()
        with monkeypatch.context() as m:
            m.setattr(held, "_rng_streams", loading)
            checkpointing.load(tmp_path / folder, model, optimizer, scheduler)
        assert torch.equal(torch.get_rng_state(), expected)
        [line] = [line for line in capsys.readouterr().err.splitlines() if "RNG streams" in line]
        return line

    trackers = ", ".join(name for name, _ in cpu_streams()[1:])
    line = move("cpu", cpu_streams, as_on_a_gpu)
    assert f"RNG streams restored: cpu; started from --seed: cuda, {trackers} (the checkpoint's are another device's" in line
    assert "tracker:model-parallel-rng 5056 B" in line, line
    line = move("gpu", as_on_a_gpu, cpu_streams)
    assert f"RNG streams restored: cpu; started from --seed: {trackers} (" in line and "cuda 16 B" in line, line
    line = move("gpu_unnamed", as_on_a_gpu, cpu_streams, old=True)
    assert f"started from --seed: {trackers} (" in line and "another device's streams 64 B" in line, line
