"""The CPU platform layer: megatron-core's CUDA-only call sites work, RNG streams behave."""

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.utils import get_default_causal_mask

from fbt_megatron import platform
from fbt_megatron.config import make_config
from fbt_megatron.model import fbt_model_spec


def test_cuda_call_sites_run_on_cpu():
    assert not platform.on_gpu() and platform.backend() == "gloo"
    mask = get_default_causal_mask(4)  # megatron builds it with device="cuda"
    assert mask.device.type == "cpu" and mask.tolist()[0] == [False, True, True, True]
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.cuda.current_device() == torch.device("cpu")


def test_model_parallel_rng_stream_is_forked_and_restored():
    platform.seed(7)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the forked stream advanced
    platform.seed(7)
    with tracker.fork():
        assert torch.equal(torch.rand(3), a)  # and is reproducible from the seed


def test_transformer_engine_spec_needs_a_gpu():
    with pytest.raises(RuntimeError, match="needs Transformer Engine on a CUDA machine"):
        fbt_model_spec(make_config("tiny"), use_transformer_engine=True)


def test_bad_model_config_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown model config field.*hiden_size"):
        make_config("tiny", hiden_size=3)
    with pytest.raises(ValueError, match="prefix_mixin_prob"):
        make_config("tiny", prefix_mixin_prob=2.0)
