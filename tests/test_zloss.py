"""The z-loss c·(log Σ exp logits)² (``fbt_megatron.model.losses``) against torch.logsumexp on whole
logits, in one process and at TP = 2; and in a real resumed training run: the z-loss off before
the cooldown and on in it, the logged phase and share of each k following the pass schedule."""

from pathlib import Path

import pytest
import torch
from helpers import build, launch, tokens

from fbt_megatron.model.losses import z_loss_coefficient
from fbt_megatron.recipe import load_recipe
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

DISTRIBUTED = Path(__file__).parent / "distributed"


def test_model_loss_with_z_loss_equals_logsumexp_on_whole_logits(one_thread):
    """FBTModel's per-token loss keeps its cross-entropy value while its gradient (every
    parameter's) is that of cross-entropy + c·lse², and the z term is measured as it enters."""
    c, x = 0.05, tokens(batch=2, seq=12)
    weights = torch.rand(2, 12, generator=torch.Generator().manual_seed(1))  # ∂(step loss)/∂(token loss)
    model = build()
    model.z_loss.start_step(c)
    token_loss, _ = model(x[:, :-1], labels=x[:, 1:])
    (token_loss * weights).sum().backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    reference = build()  # the same weights; the loss written out on the logits
    logits, _ = reference(x[:, :-1])
    lse = torch.logsumexp(logits.float(), dim=-1)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(2, 12)
    ((ce + c * lse.square()) * weights).sum().backward()

    torch.testing.assert_close(token_loss.detach(), ce.detach(), rtol=0, atol=1e-5)
    assert got.keys() == {n for n, p in reference.named_parameters() if p.grad is not None} and got
    for name, p in reference.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=2e-5, msg=name)
    torch.testing.assert_close(model.z_loss.value(model.config), (c * lse.detach().square() * weights).sum())
    plain = build()
    (plain(x[:, :-1], labels=x[:, 1:])[0] * weights).sum().backward()  # negative control: z-loss off
    assert not torch.allclose(plain.embedding.word_embeddings.weight.grad, got["embedding.word_embeddings.weight"], rtol=1e-3)


def test_z_loss_is_on_in_the_cooldown_only_unless_asked_from_the_start():
    recipe = load_recipe("recipes/tiny_cpu.yaml")
    recipe.training.z_loss_coeff = 1e-5
    assert [z_loss_coefficient(recipe.training, 6, i) for i in (0, 5, 6, 7)] == [0.0, 0.0, 1e-5, 1e-5]
    assert z_loss_coefficient(recipe.training, None, 7) == 0.0  # no cooldown (constant learning rate)
    recipe.training.z_loss_from = "start"
    assert z_loss_coefficient(recipe.training, 6, 0) == 1e-5


@pytest.mark.slow
def test_z_loss_under_tp2_equals_one_process(tmp_path):
    code, text = launch(tmp_path / "zloss.log", DISTRIBUTED / "zloss_worker.py", nproc=2)
    assert code == 0 and text.count(" ok True") == 2, text[-3000:]


PHASES = "[{start: 0.0, mixture: {1: 0.75, 2: 0.22, 3: 0.03}}, {start: 0.75, passes: 2}]"  # the tiny run's, then k = 2


@pytest.mark.slow
def test_resumed_run_logs_z_loss_from_the_cooldown_and_the_pass_phases(tiny_run, tmp_path):
    """Steps 5–8 resumed from the shared tiny run (4 steps) into the cooldown (from
    ``optimizers.schedule.cooldown_start``) and into a second pass phase (k = 2, from step 7)."""
    from fbt_megatron.optimizers.schedule import cooldown_start, lr_schedule
    from fbt_megatron.commands.train import parse_args
    from fbt_megatron.trainer.passes import pass_schedule

    flags = ["--recipe", "recipes/tiny_cpu.yaml", "--train-iters", 8, "--lr-wsd-decay-fraction", 0.5, "--z-loss-coeff", 1e-2,
             "--pass-phases", PHASES, "--log-interval", 1, "--eval-iters", 0, "--threads", 1, "--tensorboard", "false",
             "--seq-length", 32, "--micro-batch-size", 2, "--global-batch-size", 2]  # small steps: the model is the tiny run's
    run = tmp_path / "resumed"
    code, text = launch(tmp_path / "resumed.log", "fbt_megatron.train", *flags, "--override-opt-param-scheduler", "true",
                        "--load", tiny_run, "--save", run)
    assert code == 0, text[-3000:]
    records, recipe = read_metrics(run), parse_args([str(f) for f in flags])
    assert [r["step"] for r in records] == [5, 6, 7, 8]

    on = [r["step"] > cooldown_start(lr_schedule(recipe)) for r in records]  # step: 1-based
    z = [r["z_loss"] for r in records]
    assert any(on) and not all(on) and all((v > 0) if o else (v == 0) for v, o in zip(z, on)), (z, on)
    for r in records:  # the objective is cross-entropy (per pass, weighted) + z
        assert r["loss"] == pytest.approx(sum(r["pass_losses"]) / r["k"] + r["z_loss"], rel=1e-6)

    schedule = pass_schedule(recipe)
    ks = [schedule(i) for i in range(8)]
    assert ks[6:] == [2, 2] and [r["k"] for r in records] == ks[4:]
    for r in [*read_metrics(tiny_run), *records]:  # shares over all steps so far, the resumed run's from step 1
        steps = ks[: r["step"]]
        assert r["phase"] == (1 if r["step"] > 6 else 0)
        assert r["k_share"] == {str(k): steps.count(k) / len(steps) for k in sorted(set(steps))}, (r, ks)
    assert f"{records[-1]['compute_tokens']:,} equivalent-compute tokens" in text
