"""The planner (``fbt_megatron.plan``): paper recipes plan on CPU with hand-computed figures, a
layout that cannot fit is refused in one line, ``train --dry-run`` plans without data, the memory
estimate matches a real CPU step, and MFU in the training log follows the FLOPs formula."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from benchmarks.measure import Batch, SavedActivations, storage_ptrs
from test_param_count import backbone_formula

from fbt_megatron import train
from fbt_megatron.common.cli import run_cli
from fbt_megatron.common.gpus import GPUS
from fbt_megatron.launch.plan import format_plan, make_plan, memory
from fbt_megatron.launch.plan.planner import batch_fit, vocab_size
from fbt_megatron.model import fbt
from fbt_megatron.model.flops import flops_per_token, normuon_flops_per_step
from fbt_megatron.plan import main as plan_main
from fbt_megatron.recipe import Recipe, RecipeError, load_recipe
from fbt_megatron.trainer import build, loop
from fbt_megatron.trainer.metrics import tensorboard_scalars

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
PAPER = {  # recipe: (tokens, sequences per step, latent feedback)
    "fbt_1b_100b": (100e9, 36, True), "fbt_1b_200b": (200e9, 36, True), "fbt_1b_400b": (400e9, 36, True),
    "baseline_1b_100b": (100e9, 36, False), "baseline_1b_200b": (200e9, 36, False),
    "baseline_1b_400b": (400e9, 36, False), "baseline_1b_1t": (1e12, 144, False),
}
L, D, F, V, H, G, DH = 24, 1536, 6656, 100352, 16, 8, 96  # fbt-1b


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_recipe_plans_with_hand_computed_figures(name):
    tokens, sequences, feedback = PAPER[name]
    plan = make_plan(load_recipe(str(ROOT / "recipes" / f"{name}.yaml")), 8, GPUS["h100"])  # one node: TP 2 x DP 4
    steps = math.ceil(tokens / (sequences * 8192))
    assert plan.recipe.training.train_iters == steps and plan.tokens == steps * sequences * 8192
    fusion = 2 * D * D + D if feedback else 0
    assert plan.params_total == 1_060_853_760 + fusion == backbone_formula(L, D, F, V, H, G, DH) + fusion
    sharded = V * D + L * (D * (H + 2 * G) * DH + H * DH * D + D * H + 3 * D * F)  # TP 2 splits these
    assert plan.stages[0].params == sharded // 2 + L * (4 * D + 2 * DH) + D + fusion
    assert (plan.layout.tp, plan.layout.dp, plan.layout.microbatches) == (2, 4, sequences // 4)
    start = round(0.75 * steps)  # the late mixture {1: 0.75, 2: 0.22, 3: 0.03} from 75% of the steps
    expected = {1: start + 0.75 * (steps - start), 2: 0.22 * (steps - start), 3: 0.03 * (steps - start)} if feedback else {1: steps}
    assert plan.steps_per_k == pytest.approx(expected)
    k_mean = sum(k * n for k, n in expected.items()) / steps
    assert plan.flops_expected / plan.flops_single == pytest.approx(k_mean + (k_mean - 1) * 12 * D * D / plan.flops_single)
    text = format_plan(plan)
    assert f"{steps:,} × {sequences} sequences" in text and "H100" in text and "wall time at 40% MFU" in text


def hand_flops(k, layers=4, d=64, f=192, heads=4, groups=2, head_dim=16, vocab=2048, seq=128, window=32, every=2):
    """F(k) per token written out for the tiny preset: attended keys counted position by position."""
    matrices = layers * (d * (heads + 2 * groups) * head_dim + heads * head_dim * d + d * heads + 3 * d * f)
    keys = sum(min(t, seq if layer % every == 0 else window) for layer in range(1, layers + 1) for t in range(1, seq + 1)) / seq
    forward = 2 * matrices + 2 * vocab * d + 4 * heads * head_dim * keys
    return 3 * (k * forward + (k - 1) * 2 * 2 * d * d)


def test_flops_per_token_is_the_hand_formula():
    plan = make_plan(load_recipe(str(ROOT / "recipes" / "tiny_cpu.yaml")), 1)
    for k in (1, 2, 3):
        assert flops_per_token(plan.config, k) == pytest.approx(hand_flops(k), rel=1e-12)
    assert plan.flops_expected == pytest.approx((600 * hand_flops(1) + 176 * hand_flops(2) + 24 * hand_flops(3)) / 800)


def test_the_wall_time_counts_normuons_newton_schulz():
    """fbt-1b under NorMuon: 5 quintic Newton–Schulz steps per matrix, 4m²n + 2m³ each (m ≤ n),
    written out per matrix; counted once per step under the distributed optimizer, once per DP
    replica without it; the wall time is (model FLOPs + that) at the MFU."""
    ns = lambda m, n: 5 * (4 * min(m, n) ** 2 * max(m, n) + 2 * min(m, n) ** 3)  # noqa: E731
    layer = ns(H * DH, D) + 2 * ns(G * DH, D) + ns(D, H * DH) + ns(2 * F, D) + ns(D, F)
    hand = L * layer + 2 * ns(D, D)  # + the fusion's W_U and W_G
    recipe = load_recipe(str(ROOT / "recipes" / "fbt_1b_100b.yaml"))
    assert recipe.optimizer.optimizer == "normuon" and recipe.parallel.use_distributed_optimizer
    plan = make_plan(recipe, 8, GPUS["h100"])  # TP 2 × DP 4
    assert normuon_flops_per_step(plan.config) == pytest.approx(hand, rel=1e-12) and plan.optimizer_flops == pytest.approx(hand)
    work = plan.flops_expected * plan.tokens + hand * recipe.training.train_iters
    assert plan.train_seconds == pytest.approx(work / (8 * GPUS["h100"].bf16_tflops * 1e12 * 0.4))
    recipe.parallel.use_distributed_optimizer = False
    assert make_plan(recipe, 8, GPUS["h100"]).optimizer_flops == pytest.approx(4 * hand)


def test_a_layout_that_cannot_fit_is_refused_in_one_line(capsys):
    argv = ["--recipe", str(ROOT / "recipes" / "fbt_1b_100b.yaml"), "--nodes", "1", "--gpus-per-node", "4",
            "--gpu-memory-gb", "24", "--tensor-model-parallel-size", "1", "--sequence-parallel", "false"]
    with pytest.raises(SystemExit) as exit:
        run_cli(lambda: plan_main(argv))
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: does not fit:") and "activations alone" in err and "> 24.0 GiB" in err
    assert plan_main([*argv[:6], "--gpu-memory-gb", "80", *argv[8:], "--recompute-passes", "true"]) == 0  # fits with pass recompute


PAPER_ON_8X8 = (  # fbt_1b_100b on 8 nodes x 8 GPUs at TP 2: DP 32; 36 x 339,085 sequences = 32 x 381,470.6 = 64 x 190,735.3
    "training.global_batch_size 36 is not a multiple of micro_batch_size 1 x data-parallel size 32 on 64 GPUs; the nearest "
    "that fit, with the --train-iters that keep the run's 100.00B tokens: --global-batch-size 32 --train-iters 381471 or "
    "--global-batch-size 64 --train-iters 190736 (--fit-global-batch applies the nearest)")


def test_a_global_batch_that_does_not_divide_names_the_nearest_that_do(capsys):
    """The paper recipe on the most common allocation (8 x 8): refused with the batches that fit and
    the --train-iters that keep its tokens; --fit-global-batch applies the nearest and says so."""
    argv = ["--recipe", str(ROOT / "recipes" / "fbt_1b_100b.yaml"), "--nodes", "8", "--gpus-per-node", "8", "--gpu", "h100"]
    with pytest.raises(SystemExit) as exit:
        run_cli(lambda: plan_main(argv))
    assert exit.value.code == 2 and capsys.readouterr().err == f"error: {PAPER_ON_8X8}\n"
    with pytest.raises(RecipeError) as refused:  # train --dry-run's line: the same, without the planner's flag
        make_plan(load_recipe(argv[1]), 64, GPUS["h100"])
    assert str(refused.value) == PAPER_ON_8X8.removesuffix(" (--fit-global-batch applies the nearest)")
    assert plan_main([*argv, "--fit-global-batch"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--fit-global-batch: global batch 36 → 32 sequences (DP 32 on 64 GPUs), --train-iters 339085 → "
                          "381471 (the same 100.00B tokens, rounded up)\n"), out
    assert "381,471 × 32 sequences × 8,192 tokens = 100,000,333,824 tokens" in out and "DP 32 = 64" in out
    assert 381471 * 32 >= 339085 * 36 > 381470 * 32  # rounded up: never fewer tokens, by less than one step

    recipe = load_recipe(str(ROOT / "recipes" / "tiny_cpu.yaml"))  # micro batch 8, global 16
    recipe.parallel.pipeline_model_parallel_size = 2
    fit = batch_fit(recipe, 4)  # DP 2: one microbatch per step, not a whole pipeline round
    assert fit.options == [(32, 400)] and "gives 1 microbatch per step" in fit.problem()
    assert batch_fit(recipe, 2) is None  # DP 1: 2 microbatches


def test_dry_run_prints_the_plan_without_data_or_process_group(tmp_path):
    """The entry point in a fresh process, on a paper recipe whose data are placeholders."""
    run = subprocess.run([sys.executable, "-m", "fbt_megatron.train", "--recipe", "recipes/fbt_1b_100b.yaml", "--dry-run",
                          "--save", str(tmp_path / "run"), "--data-cache-path", str(tmp_path / "cache")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env={**ENV, "WORLD_SIZE": "8"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "plan: fbt-1b on 8 × no GPU (CPU)" in run.stdout and "339,085 × 36 sequences" in run.stdout
    assert not any(tmp_path.iterdir())  # no run folder, no data cache


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)


def _storage_bytes(tensors, exclude=frozenset()) -> int:
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(size for ptr, size in sizes.items() if ptr not in exclude)


FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@pytest.mark.parametrize("passes, fields", [(1, {}), (3, {}), (1, dict(recompute_passes=True)), (3, dict(recompute_passes=True)),
                                            (3, FULL), (3, dict(sliding_window=16, num_layers=2, hidden_size=128)),
                                            (1, dict(bf16=True)), (3, dict(bf16=True, recompute_passes=True))])
def test_memory_estimate_matches_a_real_cpu_step(passes, fields):
    """Measured on a real step of the run's model, DDP and optimizer: parameters, DDP's gradient
    buffers, the optimizer's state and FP32 main weights (storage bytes after the step), and the
    peak of what autograd keeps for backward (``SavedActivations``: CPU tensors have no allocator
    statistics)."""
    recipe = Recipe()
    fields = dict(fields)
    recipe.optimizer.bf16 = fields.pop("bf16", False)
    recipe.model_overrides.update(fields)
    recipe.data.seq_length, recipe.training.micro_batch_size, recipe.training.global_batch_size = 64, 4, 4
    recipe.passes.passes = passes
    vocab = vocab_size(recipe)
    config, model, ddp = build.build_model(recipe, vocab)
    optimizer, _ = build.build_optimizer(recipe, config, ddp)
    batch = Batch.random(4, 64, vocab, seed=0)
    params = list(model.parameters())
    ddp.start_step(passes)
    optimizer.zero_grad()
    with SavedActivations(storage_ptrs([*params, batch.tokens, batch.labels, batch.loss_mask])) as saved:
        fbt.multi_pass_loss(model, batch.tokens, batch.labels, batch.loss_mask, passes, batch.seeds).loss.backward()
    optimizer.step()
    state, main = optimizer.optimizer.state, [p for group in optimizer.param_groups for p in group["params"]]
    measured = {"weights": _storage_bytes(params), "gradients": sum(b.grad_data.nbytes for b in ddp.buffers),
                "optimizer": _storage_bytes([*main, *_tensors({id(p): state[p] for p in state})], storage_ptrs(params)),
                "activations": saved.peak}
    plan = make_plan(recipe, 1)
    estimate = memory.estimate(plan.config, plan.layout, plan.stages[0], passes)
    assert estimate.terms["activations"] == pytest.approx(measured["activations"], rel=0.15)
    tensors = sum(estimate.terms[term] for term in measured)  # the CPU process's own terms: test_cpu_process_terms
    assert tensors == pytest.approx(sum(measured.values()), rel=0.15)


# fbt-1b at full width, step 1 at k = 1 then k = 3 with pass recompute, NorMuon + Adam, FP32: the
# training process's peak RSS in GiB (docs/planning.md). At full vocabulary and 256 tokens, async saves
# at TP 1 (the TP 2 run saved only after its step: no copies during it); 24 layers: the default
# rehearsal's train and reshard stages (blocking saves; the peak in the last save)
MEASURED_RSS_GIB = {(2, 1, True): 5.52, (6, 1, True): 8.23, (12, 1, True): 12.29, (12, 2, True): 5.91,
                    (24, 1, False): 18.01, (24, 2, False): 9.78}
# the rehearsal's CI size (vocabulary 2,048, 32 tokens): 1 layer, its train stage (async saves) and its
# reshard stage (one step after loading, its one save after it: planned blocking); 4 layers, 4 steps
# with async saves after each
MEASURED_CI_RSS_GIB = {(1, 1, True): 1.67, (1, 2, False): 1.23, (4, 1, True): 3.59, (4, 2, True): 2.35}


def _fbt_1b_plan(layers: int, tp: int, async_save: bool, seq_length: int = 256, vocab: int = 0):
    recipe = load_recipe(str(ROOT / "recipes" / "fbt_1b_100b.yaml"))
    recipe.model_overrides.update(num_layers=layers, vocab_size=100_352)
    if vocab:  # the embedded corpus's tokenizer widened to ``vocab``, as the rehearsal's --vocab-size
        recipe.data.data_path, recipe.data.train_data_path, recipe.data.vocab_size = "data/stdlib-sp2048", None, vocab
        recipe.model_overrides.pop("vocab_size")
    recipe.data.seq_length, recipe.training.micro_batch_size, recipe.training.global_batch_size = seq_length, 1, 1
    recipe.training.train_iters, recipe.model_overrides["recompute_passes"] = 2, True
    recipe.passes.pass_phases = [{"start": 0.0, "passes": 1}, {"start": 0.5, "passes": 3}]
    recipe.parallel.tensor_model_parallel_size, recipe.parallel.sequence_parallel = tp, False
    recipe.checkpoint.async_save, recipe.optimizer.bf16 = async_save, False
    plan = make_plan(recipe, tp)
    return plan.memory[plan.chosen]


@pytest.mark.parametrize("layers, tp, async_save", sorted(MEASURED_RSS_GIB))
def test_cpu_estimate_matches_the_measured_process(layers, tp, async_save):
    """A CPU plan counts what a training process holds beside its tensors (runtime with the allocator's
    share per layer, the tied embedding's and the optimizers' transients, the async writer's copies):
    within 7% of the RSS measured at full width, 2 to 24 layers."""
    estimate = _fbt_1b_plan(layers, tp, async_save and tp == 1)
    assert {"runtime", "transients", "checkpoint copies"} <= set(estimate.terms)
    assert estimate.total / 2**30 == pytest.approx(MEASURED_RSS_GIB[layers, tp, async_save], rel=0.07)


@pytest.mark.parametrize("layers, tp, async_save", sorted(MEASURED_CI_RSS_GIB))
def test_cpu_estimate_matches_the_measured_process_at_ci_size(layers, tp, async_save):
    """The same at the rehearsal's CI size, where the runtime is most of a process: within 7%, at TP 1
    and 2 (a constant 0.7 GiB runtime planned the 1-layer reshard stage at 1.19x its RSS)."""
    estimate = _fbt_1b_plan(layers, tp, async_save, seq_length=32, vocab=2048)
    assert estimate.total / 2**30 == pytest.approx(MEASURED_CI_RSS_GIB[layers, tp, async_save], rel=0.07)


def test_mfu_in_the_log_follows_the_formula(small_corpus, tmp_path):
    """A 2-step run logging once over a k = 1 and a k = 3 step: MFU and model TFLOP/s per GPU are
    the formula's FLOPs of both steps over the window's time; without a peak (CPU) no MFU."""
    threads = torch.get_num_threads()
    flags = ["--data-path", str(Path(small_corpus.train_prefix).parent), "--corpus", "null", "--seq-length", "64",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--log-interval", "2",
             "--eval-iters", "0", "--threads", "1", "--pass-phases", "[{start: 0.5, passes: 3}]", "--tensorboard", "false"]
    try:
        [record] = loop.train(train.parse_args([*flags, "--peak-tflops", "0.001"]))
        [plain] = loop.train(train.parse_args(flags))
    finally:
        torch.set_num_threads(threads)
    window_seconds = 2 * 2 * 64 / record["tokens_per_s"]
    tflops = 2 * 64 * (hand_flops(1, seq=64, vocab=512) + hand_flops(3, seq=64, vocab=512)) / window_seconds / 1e12
    assert record["model_tflops_per_gpu"] == pytest.approx(tflops, rel=1e-9)
    assert record["mfu"] == pytest.approx(tflops / 0.001, rel=1e-9)
    assert record["tokens_per_s_per_gpu"] == record["tokens_per_s"]  # one process
    assert "mfu" not in plain and plain["model_tflops_per_gpu"] > 0
    assert {"mfu", "throughput", "tokens-per-sec-per-gpu"} <= set(tensorboard_scalars(record))  # Megatron-style tags
