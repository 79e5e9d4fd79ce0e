"""The only module that knows about the device.

With a GPU: CUDA + NCCL, and every function here is a pass-through (megatron-core runs as shipped).
Without one: CPU + gloo, and `install()` makes megatron-core's CUDA-only call sites work on CPU
(see shared/notes/megatron-cpu.md for the call sites):
  * factory calls with ``device="cuda"`` (causal masks, schedules, optimizer buffers) and
    ``Tensor.cuda()`` are redirected to the CPU by a TorchFunctionMode, also inside the
    backward of megatron's activation recompute;
  * ``torch.cuda.current_device()`` names the CPU, ``torch.cuda.synchronize()`` is a no-op, and
    ``torch.cuda.current_stream()`` (megatron-core >= 0.19's gradient sync) is a stream that has
    nothing to wait for (CPU work runs in program order);
  * the model-parallel RNG tracker keeps CPU generator states (the device generator *is* the
    CPU generator here), so forked dropout and activation recompute replay the same numbers.
With ``FBT_SIMULATED_DEVICE=1`` (tests): the same CPU set-up, but the compute device is
``fakegpu:0`` and the default backend ``fakenccl`` (``fbt_megatron.testing.simulated_device``, test
infrastructure looked up by name only then): a device that is not the host, so that host tensors on
device groups fail as on NCCL. CUDA call sites then go to that device.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import io
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from fbt_megatron.common import compat, megatron_fixes, processes

SIMULATED_DEVICE = "FBT_SIMULATED_DEVICE"  # tests: compute on a GPU stand-in (``_simulation``)
_SIMULATION = "fbt_megatron.testing.simulated_device"
_installed = False
_timeout = datetime.timedelta(minutes=10)  # the process groups' (init_distributed); torch's NCCL default until then


def on_gpu() -> bool:
    return torch.cuda.is_available()


def simulated() -> bool:
    """The compute device is a simulated one that is not the host (``FBT_SIMULATED_DEVICE=1``, tests)."""
    return not on_gpu() and os.environ.get(SIMULATED_DEVICE, "") not in ("", "0")


def _simulation():
    """The tests' simulated device (``fbt_megatron.testing.simulated_device``), loaded by name when
    ``simulated()``: test infrastructure that the ground floor does not import."""
    return importlib.import_module(_SIMULATION)


def node_name() -> str:
    """This process's node: Slurm's name for it (``SLURMD_NODENAME``), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def device() -> torch.device:
    if on_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return _simulation().device() if simulated() else torch.device("cpu")


def backend() -> str:
    if on_gpu():
        return "nccl"
    return _simulation().BACKEND if simulated() else "gloo"


def generator(device) -> torch.Generator:
    """A new generator for draws on ``device``; the simulated device draws from a host generator
    (its tensors compute on the host), so its numbers are a CPU run's. (No device of its type exists
    before its module is loaded.)"""
    simulation = sys.modules.get(_SIMULATION)
    simulated_type = simulation is not None and torch.device(device).type == simulation.DEVICE_TYPE
    return torch.Generator(device="cpu" if simulated_type else device)


def have_transformer_engine() -> bool:
    """True when Transformer Engine's PyTorch modules import on a CUDA machine, or on the simulated
    device (whose TE is the tests' double, ``tests/doubles``). The top-level ``transformer_engine``
    imports without them (its ``__init__`` does not load ``.pytorch``), so a TE built against
    another torch would pass that and fail in megatron-core's TE spec."""
    if not (on_gpu() or simulated()):
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError):  # OSError: a TE library built against another torch or CUDA
        return False
    return True


def gradient_accumulation_fusion() -> bool:
    """Whether weight gradients can be accumulated by their GEMM straight into DDP's fp32
    ``main_grad`` (no bf16 ``.grad`` and add; megatron-core's ``gradient_accumulation_fusion``):
    TE's linears do it, megatron-core's own (the headwise gate, the output layer) need Apex's
    ``fused_weight_gradient_mlp_cuda``. Only for models in megatron-core's DDP, which makes ``main_grad``."""
    if not have_transformer_engine():
        return False
    from megatron.core.tensor_parallel import layers

    return layers._grad_accum_fusion_available


def require_transformer_engine(what: str) -> None:
    if not have_transformer_engine():
        raise RuntimeError(
            f"{what} needs Transformer Engine on a CUDA machine: run in the project's image (NGC PyTorch with the "
            "wheelhouse: packaging/container/Dockerfile, docs/gpu.md#the-container); Transformer Engine comes with "
            "the image — do not pip-install it, or vLLM, into it"
        )


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to this process's device (the CPU, or the simulated device)
    for code written for GPUs only."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = device()
        if func is torch.Tensor.cuda:
            return args[0].to(target)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            # megatron's optimizers pick code paths by CUDA type names ('torch.cuda.FloatTensor')
            if sys._getframe(1).f_globals.get("__name__", "").startswith("megatron.core.optimizer"):
                name = "torch.cuda." + name.split(".")[-1]
            return name
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": target}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], target, *args[2:])
        return func(*args, **kwargs)


class _CpuStream:
    """``torch.cuda.current_stream()`` on the CPU: work runs in program order, nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuRNGStatesTracker:
    """Megatron's CudaRNGStatesTracker on CPU generator states (same names, same semantics)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()
        self._current_state_name = "default-rng"

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"rng state {name} (seed {seed}) already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install() -> None:
    """Make megatron-core usable on this process's device. Idempotent; on GPU only the
    process-lifetime rules, the release differences and megatron-core's bug fixes apply."""
    global _installed
    if _installed:
        return
    processes.install()  # what this process starts dies with it
    compat.apply()  # what differs between the megatron-core releases tested
    megatron_fixes.apply()  # bugs of megatron-core itself, on any device
    if on_gpu():
        _installed = True
        return
    from megatron.core.tensor_parallel import random as mp_random

    if simulated():
        _simulation().install()
    torch.cuda.current_device = device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _CpuStream()
    # activation recompute saves/restores "the device generator": on CPU that is the CPU one
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mp_random._CUDA_RNG_STATE_TRACKER = _CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _CudaToCpu().__enter__()  # stays active for the life of the process, on this thread ...
    # ... but autograd runs backward without torch-function modes: activation recompute
    # re-runs forward code (causal masks on "cuda") there, so it gets the mode too
    recompute_backward = mp_random.CheckpointFunction.backward

    def backward_on_cpu(ctx, *grads):
        with _CudaToCpu():
            return recompute_backward(ctx, *grads)

    mp_random.CheckpointFunction.backward = staticmethod(backward_on_cpu)
    _installed = True


def seed(seed_value: int) -> None:
    """Megatron's seeding: one default stream (same on every rank of a model-parallel group),
    a tensor-parallel stream that differs per TP rank (forked for dropout inside TP regions)."""
    from megatron.core import parallel_state, tensor_parallel

    if on_gpu():
        torch.manual_seed(seed_value)
        tensor_parallel.model_parallel_cuda_manual_seed(seed_value)
        return
    torch.manual_seed(seed_value)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker.add("data-parallel-rng", seed_value)
    tracker.add("model-parallel-rng", seed_value + 2718 + tp_rank)
    tracker.add("expert-parallel-rng", seed_value + 1024)


def init_distributed(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    seed_value: int = 1234,
    timeout_s: int = 600,
    context_parallel_size: int = 1,
) -> None:
    """Start torch.distributed (env:// under torchrun, a private one-process group otherwise)
    and megatron-core's parallel state, then seed. The one entry point every process calls."""
    from megatron.core import parallel_state

    global _timeout
    install()
    if not dist.is_initialized():
        _timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ:  # torchrun / srun with the env:// variables
            _whole_lines()
            if on_gpu():
                torch.cuda.set_device(local_device_index())
            dist.init_process_group(backend(), timeout=_timeout)
        else:  # launched alone: a group of one on a private port
            init = f"tcp://127.0.0.1:{_free_port()}"
            dist.init_process_group(backend(), init_method=init, rank=0, world_size=1, timeout=_timeout)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            context_parallel_size=context_parallel_size,
            distributed_timeout_minutes=max(1, -(-timeout_s // 60)),
        )
    seed(seed_value)


def collective_timeout() -> datetime.timedelta:
    """The process groups' timeout ``init_distributed`` gave torch.distributed and megatron-core's
    groups, for a group made later: torch gives a gloo group its own default (30 minutes) whatever
    the default group's is."""
    return _timeout


def local_device_index() -> int:
    """This process's GPU among those it sees: ``LOCAL_RANK`` modulo their number. Under torchrun, or
    Slurm tasks that each see the node's GPUs, that is ``LOCAL_RANK``; where Slurm binds one GPU per
    task (``--gpus-per-task=1``, ``--gpu-bind``; a cluster default on some), each task sees one GPU,
    device 0, and ``LOCAL_RANK`` itself would be an invalid device ordinal."""
    return int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()


def _whole_lines() -> None:
    """Each printed line one write: the ranks share one output (torchrun's, srun's), and under
    ``python -u`` / PYTHONUNBUFFERED (common in Slurm scripts) a print writes its text and its
    newline apart, so another rank's line could land between them."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(write_through=False, line_buffering=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
