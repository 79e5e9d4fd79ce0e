"""A compute device that is not the host, on a CPU: the suite's view of what CUDA + NCCL refuse.

On a CPU run the compute device *is* the host and every collective runs on gloo, which takes any
tensor, so a host tensor sent to a tensor-parallel all-gather (NCCL: CUDA tensors only) passes
every test. With ``FBT_SIMULATED_DEVICE=1`` ``platform`` computes on ``fakegpu:0`` instead: torch's
PrivateUse1 device, registered from Python. A ``fakegpu`` tensor wraps a CPU tensor and runs the
same CPU kernels (the numbers of a CPU run), but it reports the other device, so:

* an op mixing a ``fakegpu`` tensor with a host tensor that is not a 0-dim scalar fails as on CUDA
  ("Expected all tensors to be on the same device"), copies and indexing with host indices aside;
* the default process group, and every group made from it (megatron-core's TP, CP, PP, DP, the
  distributed optimizer's, NorMuon's), runs the ``fakenccl`` c10d backend, registered for
  ``fakegpu`` only: c10d picks a group's backend by the tensors' device, so a host tensor on such a
  group fails in torch's own check with NCCL's error ("No backend type associated with device type
  cpu"); object collectives and barriers go through the device, as on NCCL;
* a gloo group (megatron-core's ``*_gloo`` groups, the stop flags of ``stopping``) refuses
  ``fakegpu`` tensors: the project keeps host tensors there.

Underneath, ``fakenccl`` is gloo over the same ranks: a device collective unwraps its tensors and
runs on a host twin of its group. Every op goes through Python here, so this mode is for tests of a
few steps, not for speed.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ProcessGroupGloo
from torch.utils._pytree import tree_map

DEVICE_TYPE = "fakegpu"
BACKEND = "fakenccl"
DEVICE = f"{DEVICE_TYPE}:0"  # a string: torch knows the name only once install() has registered it
_HOST = torch.device("cpu")
_DATA = torch._C.TensorBase.__dict__["data"]  # its __set__ is a new method object at every access
# ops that take host tensors beside device ones on CUDA too: copies, indexing with host indices
_MIXED_OK = {"copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "index", "index_put_",
             "_index_put_impl_", "set_", "lift_fresh"}
_installed = False


class DeviceTensor(torch.Tensor):
    """A tensor on ``fakegpu:0`` holding a CPU tensor (``_host``) that its ops compute on."""

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, host.size(), strides=host.stride(), storage_offset=host.storage_offset(), dtype=host.dtype,
            layout=host.layout, device=device(), requires_grad=False,
        )
        tensor._host = host
        return tensor

    def __repr__(self, *, tensor_contents=None):
        return f"{self._host!r} on {DEVICE}"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist:  # a copy to the host, as on CUDA
            return func(args[0]._host, *args[1:], **kwargs)
        if func is torch.Tensor.numpy:  # CUDA's refusal
            raise TypeError(f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        if func.__name__ == "__set__" and getattr(func, "__self__", None) is _DATA:  # param.data = other: this tensor computes on other's host tensor from now on
            tensor, value = args
            if not isinstance(value, DeviceTensor):
                raise RuntimeError(f"{DEVICE}: .data set to a tensor on {value.device} (a GPU tensor would move to it)")
            tensor._host = value._host
        with torch._C.DisableTorchFunctionSubclass():  # results keep the types __torch_dispatch__ gave them
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            return _collective(func, args, kwargs)
        name = func._schema.name.split("::")[-1]
        if name not in _MIXED_OK:
            _same_device(func, args, kwargs)
        wrappers = {}

        def host(x):
            if isinstance(x, DeviceTensor):
                wrappers[id(x._host)] = x
                return x._host
            if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
                return _HOST
            return x

        out = func(*tree_map(host, args), **tree_map(host, kwargs))
        target = kwargs.get("device")
        if target is not None and torch.device(target).type != DEVICE_TYPE:
            return out  # an explicit copy off the device (.cpu(), .to("cpu"))
        return tree_map(lambda x: _wrap(x, wrappers), out)


def _wrap(x, wrappers: dict):
    """A result on the device: the caller's own tensor for an in-place op's result, else a new one."""
    if not isinstance(x, torch.Tensor) or isinstance(x, DeviceTensor):
        return x
    mine = wrappers.get(id(x))
    return DeviceTensor(x) if mine is None else mine


def _same_device(func, args, kwargs) -> None:
    """CUDA's rule: a kernel's tensors on one device, host 0-dim tensors allowed as scalars."""
    for x in (*torch.utils._pytree.tree_leaves(args), *torch.utils._pytree.tree_leaves(kwargs)):
        if isinstance(x, torch.Tensor) and not isinstance(x, DeviceTensor) and x.dim() > 0:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE} and "
                f"{x.device}! (in {func}: a host tensor of shape {tuple(x.shape)} beside device tensors)"
            )


# ---------------------------------------------------------------- collectives
_host_groups = {}  # a device group's name → its host twin (the same gloo backend, for CPU tensors)


def _create_backend(store, rank: int, size: int, timeout):
    return ProcessGroupGloo(store, rank, size, timeout)


def _host_twin(group: ProcessGroup) -> ProcessGroup:
    if group.group_name not in _host_groups:
        try:
            backend = group._get_backend(device())
        except RuntimeError:
            raise RuntimeError(
                f"a {DEVICE_TYPE} tensor on a host (gloo) process group '{group.group_name}': this "
                "project's gloo groups take host tensors (on a GPU this is a CUDA tensor on gloo)"
            ) from None
        twin = ProcessGroup(dist.HashStore(), group.rank(), group.size())
        twin._register_backend(_HOST, ProcessGroup.BackendType.GLOO, backend)
        twin._set_default_backend(ProcessGroup.BackendType.GLOO)
        _host_groups[group.group_name] = twin
    return _host_groups[group.group_name]


def _collective(func, args, kwargs):
    """A c10d op with device tensors: the same op on their host tensors over the group's host twin."""
    wrappers = {}

    def host(x):
        if isinstance(x, DeviceTensor):
            wrappers[id(x._host)] = x
            return x._host
        if isinstance(x, torch.ScriptObject) and "ProcessGroup" in str(x._type()):
            return _host_twin(ProcessGroup.unbox(x)).boxed()
        return x

    out = func(*tree_map(host, args), **tree_map(host, kwargs))
    return tree_map(lambda x: _wrap(x, wrappers), out)


# ---------------------------------------------------------------- factories
def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return DeviceTensor(torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return DeviceTensor(torch.empty_strided(size, stride, dtype=dtype, layout=layout))


def _host_of(x):
    return x._host if isinstance(x, DeviceTensor) else x


def _copy_from(src, dst, non_blocking=False):
    _host_of(dst).copy_(_host_of(src))
    return dst


def _copy_from_and_resize(src, dst):
    _host_of(dst).resize_(src.shape).copy_(_host_of(src))
    return dst


def _keeping_attributes(apply):
    """``Module._apply`` (``.to()``, ``.cuda()``) keeping each parameter's attributes: a move to CUDA
    keeps the Parameter object (its data is set), so megatron's flags (``sequence_parallel``,
    ``tensor_model_parallel``, ...) survive it; a host parameter moved here becomes a new object."""

    def _apply(module, fn, *args, **kwargs):
        before = {name: dict(p.__dict__) for name, p in module._parameters.items() if p is not None}
        out = apply(module, fn, *args, **kwargs)
        for name, attributes in before.items():
            moved = module._parameters.get(name)
            for key, value in attributes.items():
                if key != "_host" and moved is not None and key not in moved.__dict__:
                    setattr(moved, key, value)
        return out

    return _apply


_library = None


def device() -> torch.device:
    install()
    return torch.device(DEVICE)


def install() -> None:
    """Register ``fakegpu`` and ``fakenccl`` in this process (idempotent)."""
    global _installed, _library
    if _installed:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(DEVICE_TYPE)
    # factories with device="fakegpu" (no device tensor among their arguments) reach these kernels
    _library = torch.library.Library("aten", "IMPL")
    _library.impl("empty.memory_format", _empty, "PrivateUse1")
    _library.impl("empty_strided", _empty_strided, "PrivateUse1")
    _library.impl("_copy_from", _copy_from, "PrivateUse1")  # copies to the device below the Python key
    _library.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
    dist.Backend.register_backend(BACKEND, _create_backend, devices=[DEVICE_TYPE])
    torch.nn.Module._apply = _keeping_attributes(torch.nn.Module._apply)
    _installed = True
