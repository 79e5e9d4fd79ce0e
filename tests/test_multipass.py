"""The k-pass step against the sequential recurrence and a reference autograd computation."""

import pytest
import torch
from helpers import build, tokens
from reference import Reference

from fbt_megatron.model import fbt


def fixed_prefix_feedback(prefix):
    """Feedback for every pass with one fixed prefix length and no jitter (decoding-time input)."""

    def make(state, j):
        s, b, _ = state.shape
        return fbt.Feedback(state, fbt.fuse_mask(torch.full((b,), prefix), s, state.device))

    return make


@pytest.mark.parametrize("prefix", [0, 1, 5])
@pytest.mark.parametrize("feedback_state", ["residual", "final_norm"])
def test_parallel_passes_equal_sequential_recurrence(prefix, feedback_state):
    """With prefix p and k = T − p + 1 passes the teacher-forced parallel passes reproduce the
    token-by-token latent-feedback recurrence at every position; one pass fewer does not."""
    model = build(sliding_window=8, feedback_state=feedback_state).eval()
    x = tokens(seq=14)
    inp = x[:, :-1]
    T = inp.shape[1]
    k = T - max(prefix, 1) + 1
    expected = Reference(model.config, model.state_dict()).recurrence(inp, prefix)

    # the logits of pass k, passes run in parallel over all positions
    with torch.no_grad():
        state, fb = None, fixed_prefix_feedback(prefix)
        for j in range(1, k + 1):
            logits, state = model(inp, feedback=None if state is None else fb(state, j))
    diff = (logits - expected).abs().max().item()
    print(f"prefix={prefix} k={k} max|parallel - recurrence| = {diff:.3e}")
    assert diff < 1e-5

    with torch.no_grad():  # negative control: k − 1 passes leave the last position unconverged
        state = None
        for j in range(1, k):
            short, state = model(inp, feedback=None if state is None else fb(state, j))
    assert (short[:, -1] - expected[:, -1]).abs().max() > 1e-4
    torch.testing.assert_close(short[:, :-1], expected[:, :-1], rtol=0, atol=1e-5)


def recorded_draws(model, seeds):
    """The production draws (prefix mixin + jitter), recorded so the reference can reuse them."""
    record = []

    def make(state, j):
        fb_j = fbt.make_feedback(model.config, state, seeds, j, training=True)
        record.append(fb_j)
        return fb_j

    return make, record


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("detach", [False, True])
def test_three_pass_gradients_match_reference_autograd(detach):
    model = build(sliding_window=8, prefix_mixin_prob=1.0, detach_feedback=detach, pass_weights=(0.5, 0.3, 0.2)).train()
    x = tokens(batch=3, seq=20)
    inp, labels = x[:, :-1], x[:, 1:]
    mask = torch.ones_like(inp)
    mask[1, :4] = 0
    seeds = [11, 12, 13]
    make, record = recorded_draws(model, seeds)
    out = fbt.multi_pass_loss(model, inp, labels, mask, 3, seeds, make)
    out.loss.backward()

    ref = Reference(model.config, model.state_dict(), requires_grad=True)
    losses, deltas = ref.multi_pass(inp, labels, mask, record, detach=detach)
    total = 0.5 * losses[0] + 0.3 * losses[1] + 0.2 * losses[2]
    total.backward()

    torch.testing.assert_close(torch.stack(out.pass_losses), torch.stack(losses).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(out.state_delta_squares).sqrt(), torch.stack(deltas).detach(), rtol=1e-5, atol=1e-6)
    got = grads(model)
    worst = 0.0
    for name, g in got.items():
        r = ref.w[name].grad
        worst = max(worst, ((g - r).abs().max() / r.abs().max().clamp(min=1e-12)).item())
    print(f"detach={detach}: worst relative gradient difference {worst:.2e} over {len(got)} tensors")
    assert worst < 1e-5
    assert len(got) == len(ref.w)
    assert got["feedback_fusion.linear_state.weight"].abs().max() > 0


def test_prefix_mixin_and_jitter_were_active():
    """The draws used above are not trivial: prefixes vary per sequence and pass, jitter has σ."""
    model = build(prefix_mixin_prob=1.0)
    state = torch.zeros(400, 3, model.config.hidden_size)
    a = fbt.make_feedback(model.config, state, [1, 2, 3], 2, training=True)
    b = fbt.make_feedback(model.config, state, [1, 2, 3], 3, training=True)
    assert not torch.equal(a.fuse_mask, b.fuse_mask)
    assert abs(a.jitter.std().item() - 0.02) < 2e-3
    again = fbt.make_feedback(model.config, state, [1, 2, 3], 2, training=True)
    assert torch.equal(a.fuse_mask, again.fuse_mask) and torch.equal(a.jitter, again.jitter)
    evaluation = fbt.make_feedback(model.config, state, [1, 2, 3], 2, training=False)
    assert evaluation.jitter is None and evaluation.fuse_mask[1:].all() and not evaluation.fuse_mask[0].any()


def test_fuse_mask_positions():
    mask = fbt.fuse_mask(torch.tensor([0, 1, 3, 6]), 6, "cpu")  # [s, b]
    assert mask[:, 0].tolist() == [False, True, True, True, True, True]  # t ≥ 2
    assert mask[:, 1].tolist() == [False, True, True, True, True, True]
    assert mask[:, 2].tolist() == [False, False, False, True, True, True]  # t > 3
    assert not mask[:, 3].any()


def test_prefix_length_distribution():
    model = build(prefix_mixin_prob=0.5, prefix_mixin_max_fraction=0.5)
    p = fbt.prefix_lengths(model.config, list(range(4000)), 2, 100)
    assert p.min() == 0 and p.max() == 49
    zero_share = (p == 0).float().mean().item()
    assert abs(zero_share - (0.5 + 0.5 / 50)) < 0.03


RECOMPUTE = {
    "pass_level": dict(recompute_passes=True),
    "megatron_full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "megatron_selective": dict(recompute_granularity="selective"),
    "pass_level_and_megatron_full": dict(
        recompute_passes=True, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
}
OFFLOAD = dict(offload_recompute_inputs=True, min_offloaded_tensor_size=0)
for _name in ("pass_level", "megatron_full", "pass_level_and_megatron_full"):
    RECOMPUTE[_name + "_offloaded"] = {**RECOMPUTE[_name], **OFFLOAD}


@pytest.mark.parametrize("recompute", sorted(set(RECOMPUTE) - {"pass_level", "pass_level_offloaded"}))  # those two:
def test_activation_recompute_gives_identical_gradients(recompute):  # test_last_pass_is_not_recomputed
    """k = 3 with jitter and prefix mixin: recompute changes memory, never the numbers."""
    x = tokens(batch=2, seq=16)
    inp, labels, mask = x[:, :-1], x[:, 1:], torch.ones_like(x[:, 1:])
    results = []
    for overrides in ({}, RECOMPUTE[recompute]):
        model = build(prefix_mixin_prob=1.0, **overrides).train()
        out = fbt.multi_pass_loss(model, inp, labels, mask, 3, [5, 6])
        out.loss.backward()
        results.append((out.loss.detach(), grads(model)))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("offload", [False, True], ids=["kept", "offloaded"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_last_pass_is_not_recomputed(k, offload):
    """With ``recompute_passes`` a layer runs k forwards and k − 1 recomputes: passes 1..k−1 run
    without a graph and again in backward, pass k (whose backward follows at once) once with its
    graph; the losses and gradients equal the step's without recompute."""
    x = tokens(batch=2, seq=16)
    inp, labels, mask = x[:, :-1], x[:, 1:], torch.ones_like(x[:, 1:])
    results = []
    for overrides in ({}, dict(recompute_passes=True, **(OFFLOAD if offload else {}))):
        model = build(prefix_mixin_prob=1.0, **overrides).train()
        graph = []  # per forward call of the first layer: did it record a graph
        model.decoder.layers[0].register_forward_hook(lambda *_: graph.append(torch.is_grad_enabled()))
        out = fbt.multi_pass_loss(model, inp, labels, mask, k, [5, 6])
        out.loss.backward()
        results.append((torch.stack(out.pass_losses), grads(model), graph))
    (l0, g0, plain), (l1, g1, recomputed) = results
    assert plain == [True] * k
    assert recomputed == [False] * (k - 1) + [True] + [True] * (k - 1)
    torch.testing.assert_close(l1, l0, rtol=0, atol=1e-6)
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-6, atol=1e-6)


def test_single_pass_needs_no_feedback_and_baseline_refuses_it():
    model = build(latent_feedback=False)
    assert model.feedback_fusion is None
    x = tokens(seq=8)
    out = fbt.multi_pass_loss(model, x[:, :-1], x[:, 1:], torch.ones_like(x[:, 1:]), 1, [0, 1])
    assert out.state_delta_squares == [] and len(out.pass_losses) == 1
    with pytest.raises(ValueError, match="without latent feedback"):
        fbt.multi_pass_loss(model, x[:, :-1], x[:, 1:], torch.ones_like(x[:, 1:]), 2, [0, 1])
