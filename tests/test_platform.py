"""The CPU platform layer: megatron-core's CUDA-only call sites work, RNG streams behave."""

import re

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.utils import get_default_causal_mask

from fbt_megatron.common import platform
from fbt_megatron.model.config import make_config
from fbt_megatron.model.fbt_model import fbt_model_spec


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


def _init_on_a_gpu_node(monkeypatch, gpus: int, local_rank: int, timeout_s: int) -> dict:
    """``platform.init_distributed`` as a rank under torchrun or srun on a GPU node whose process
    sees ``gpus`` GPUs, torch.distributed and megatron-core's groups stood in: what each was given."""
    from megatron.core import parallel_state

    given = {}
    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    monkeypatch.setattr(platform, "_timeout", platform._timeout)  # restored after the test
    monkeypatch.setattr(platform, "seed", lambda value: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: given.setdefault("device", index))
    monkeypatch.setattr(platform.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(platform.dist, "init_process_group", lambda backend, timeout: given.update(backend=backend, timeout=timeout))
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda **kwargs: given.update(megatron=kwargs))
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    platform.init_distributed(timeout_s=timeout_s)
    return given


@pytest.mark.parametrize("gpus,local_rank,device", [(8, 3, 3), (1, 3, 0), (4, 5, 1)])
def test_each_rank_takes_a_gpu_it_sees(monkeypatch, gpus, local_rank, device):
    """torchrun (every GPU of the node visible): local rank 3 takes GPU 3. Slurm binding one GPU
    per task (``--gpus-per-task=1``): the task sees one GPU, device 0; ``set_device(3)`` there is
    "invalid device ordinal"."""
    assert _init_on_a_gpu_node(monkeypatch, gpus, local_rank, 600)["device"] == device


def test_the_process_groups_outlast_the_hang_watchdog(monkeypatch):
    """With the defaults (groups 10 minutes, watchdog 30) NCCL's own timeout would end a hang first:
    an abort (exit 134 on Slurm) without the watchdog's stacks and one line. The groups get the
    watchdog's timeout plus the time it takes to report and end the run; a longer
    ``--distributed-timeout-minutes`` is kept, and without a watchdog the flag holds. The run's gloo
    groups made later (the stop check's) get the same timeout, not gloo's 30 minutes."""
    import datetime

    from fbt_megatron.recipe import TrainingSection
    from fbt_megatron.trainer.callbacks.watchdog import CHECK_S, FIRES_WITHIN_S, GRACE_S, collective_timeout_s

    defaults = TrainingSection.__dataclass_fields__
    flag, hang = defaults["distributed_timeout_minutes"].default, defaults["hang_timeout_minutes"].default
    timeout_s = collective_timeout_s(flag, hang)
    assert timeout_s == 60 * hang + FIRES_WITHIN_S > 60 * hang + CHECK_S + GRACE_S and timeout_s > 60 * flag
    assert collective_timeout_s(60, hang) == 3600 and collective_timeout_s(flag, 0) == 60 * flag
    given = _init_on_a_gpu_node(monkeypatch, 8, 0, timeout_s)
    assert given["backend"] == "nccl" and given["timeout"] == datetime.timedelta(seconds=timeout_s)
    assert given["megatron"]["distributed_timeout_minutes"] * 60 >= timeout_s  # megatron-core's groups, gloo ones included
    assert platform.collective_timeout() == given["timeout"]


_RANK_PRINTS = """
import sys
from fbt_megatron.common import platform
platform.init_distributed(timeout_s=120)
rank = sys.argv[1]
for i in range(2000):
    print(f"rank {rank} line {i} " + "x" * 40, flush=True)
"""


def test_ranks_sharing_one_output_under_python_u_write_whole_lines(tmp_path):
    """Two real ranks (env:// as torchrun and srun start them) print to one file under
    PYTHONUNBUFFERED=1, as Slurm scripts often set it: every line arrives whole. (Unbuffered, a
    print writes its text and its newline apart, and most lines come out torn.)"""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "out.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        ranks = [subprocess.Popen([sys.executable, "-c", _RANK_PRINTS, str(r)], cwd=Path(__file__).parent.parent, stdout=out,
                                  stderr=subprocess.PIPE, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
        errors = [p.communicate(timeout=300)[1].decode() for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], errors
    lines = log.read_text().splitlines()
    torn = [line for line in lines if not re.fullmatch(r"rank [01] line \d+ x{40}", line)]
    assert len(lines) == 4000 and not torn, torn[:5]
