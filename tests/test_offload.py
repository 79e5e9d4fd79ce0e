"""Offloading recompute inputs to host memory: what moves, that the device copies are released,
and that it refuses configs with nothing to offload. (Equal numbers: test_multipass's recompute
test runs every recompute mode with offloading too; test_parallel's matrix under PP and DP.)"""

import gc
import weakref

import pytest
import torch
from helpers import build, tokens

from fbt_megatron.model import fbt
from fbt_megatron.model.config import make_config
from fbt_megatron.model.offload import STATS

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def run_forward(k=3, **overrides):
    """k-pass forward with jitter/prefix mixin; returns (output, weakrefs to the states fed back)."""
    model = build(prefix_mixin_prob=1.0, min_offloaded_tensor_size=0, **overrides).train()
    x = tokens(batch=2, seq=16)
    states = []
    default = fbt.default_feedback(model, x[:, :-1], [5, 6])

    def feedback(state, j):
        states.append(weakref.ref(state))
        return default(state, j)

    STATS.reset()
    out = fbt.multi_pass_loss(model, x[:, :-1], x[:, 1:], torch.ones_like(x[:, 1:]), k, [5, 6], feedback)
    return model, out, states


def activation_bytes(model, passes_times_layers):
    c = model.config
    return passes_times_layers * 2 * 16 * c.hidden_size * 4  # [s=16, b=2, h] fp32


@pytest.mark.parametrize(
    "overrides,regions",
    [
        (dict(recompute_passes=True), 2 + 1),  # e_t of passes 1, 2 and s^{(1)}: pass 3 is not recomputed
        (FULL, 3 * 4),  # every layer's input in every pass (4 layers)
        # passes 1, 2 as above (their layers' inputs are only saved in backward); pass 3's layer inputs
        (dict(recompute_passes=True, **FULL), 2 + 1 + 4),
    ],
    ids=["pass_level", "megatron_full", "both"],
)
def test_offloaded_bytes_are_the_recompute_inputs(overrides, regions):
    model, out, _ = run_forward(offload_recompute_inputs=True, **overrides)
    assert STATS.bytes == activation_bytes(model, regions)
    out.loss.backward()  # the recompute in backward offloads nothing more
    assert STATS.bytes == activation_bytes(model, regions)


@pytest.mark.parametrize("offload", [False, True])
def test_fed_back_state_leaves_the_device_until_backward(offload):
    """Pass 2's checkpoint saves the carried state s^{(1)}: without offloading autograd keeps that
    tensor alive until backward; with it only the host copy is kept. Pass 3 (the last, not
    recomputed) saves only tensors computed from s^{(2)}, which is freed either way."""
    _, out, states = run_forward(recompute_passes=True, offload_recompute_inputs=offload)
    gc.collect()
    alive = [ref() is not None for ref in states]
    assert len(alive) == 2
    assert alive == [not offload, False]
    out.loss.backward()


def test_offloading_needs_recompute():
    with pytest.raises(ValueError, match="offload_recompute_inputs .* needs recompute_passes"):
        make_config("tiny", offload_recompute_inputs=True)
    with pytest.raises(ValueError, match="recompute_method 'uniform'"):
        make_config("tiny", offload_recompute_inputs=True, recompute_granularity="full", recompute_method="block",
                    recompute_num_layers=2)


def test_kept_tensors_stay_and_the_rest_come_back_equal():
    """``keep`` (what a pipeline schedule holds anyway) is not copied; offloaded tensors return equal."""
    from megatron.core import tensor_parallel

    from fbt_megatron.model.offload import HostOffload

    a, b = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    STATS.reset()
    with HostOffload(0, keep=(b,)):
        out = tensor_parallel.checkpoint(lambda x, y: (x * y).sin(), False, a, b)
    assert STATS.tensors == 1 and STATS.bytes == a.numel() * 4
    out.sum().backward()
    torch.testing.assert_close(a.grad, (a * b).cos() * b, rtol=0, atol=0)
    torch.testing.assert_close(b.grad, (a * b).cos() * a, rtol=0, atol=0)


def test_fp8_recompute_goes_through_transformer_engines_checkpoint():
    """Under FP8 a recomputed pass must use TE's checkpoint (it marks the recompute for TE's modules),
    as megatron-core's TransformerBlock does; megatron's checkpoint otherwise. Without TE (this CPU)
    megatron's te_checkpoint is reached and says TE is not installed; with the TE double the passes
    run through it (tests/test_device_contracts.py)."""
    from fbt_megatron.model.te_calls import checkpoint

    x = torch.randn(4, requires_grad=True)
    plain = checkpoint(make_config("tiny"), lambda a, b: a * b, x, torch.full((4,), 2.0))
    plain.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.0))
    with pytest.raises(ImportError, match="Transformer Engine is not installed"):
        checkpoint(make_config("tiny", fp8="hybrid", recompute_passes=True), lambda a, b: a * b, x, x)
