"""What every TE module does around its forward (TE: pytorch/module/base.py)."""

from __future__ import annotations

import io
from typing import Optional

import torch

from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch import distributed as te_distributed
from transformer_engine.pytorch.quantization import DelayedScalingState, FP8GlobalStateManager

_dummy_wgrads = {}


def gpu() -> torch.device:
    """TE's device: CUDA, or on a CPU-only machine the PrivateUse1 device standing for it (the
    simulated device of ``fbt_megatron.testing.simulated_device``), else the host."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    name = torch._C._get_privateuse1_backend_name()
    return torch.device(name, 0) if name != "privateuseone" else torch.device("cpu")


def get_dummy_wgrad(shape, dtype, zero: bool = False) -> torch.Tensor:
    """The gradient TE hands autograd for a weight whose gradient went into ``main_grad``: a cached
    tensor of uninitialised memory (TE: base.py:85-98), here NaN so that any reader shows; zeros
    when the weight asks for them (``zero_out_wgrad``)."""
    key = (*shape, dtype)
    if key not in _dummy_wgrads:
        _dummy_wgrads[key] = torch.full(shape, float("nan"), dtype=dtype, device=gpu())
    if zero:
        _dummy_wgrads[key].fill_(0)
    return _dummy_wgrads[key].detach()


def device_of(device) -> torch.device:
    """TE's ``device`` argument: "cpu" (megatron's CPU initialisation), else TE's device."""
    return torch.device("cpu") if str(device) == "cpu" else gpu()


class TransformerEngineBaseModule(torch.nn.Module):
    """FP8 metadata per module and the checks TE makes before a forward."""

    def __init__(self, num_gemms: int = 1):
        super().__init__()
        self.fp8_meta = {"num_gemms": num_gemms}
        self.fp8 = False
        self.fp8_initialized = False
        self.tp_group, self.tp_size, self.sequence_parallel = None, 1, False

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group

    def init_fp8_metadata(self, device) -> None:
        """FP8 on or off for this forward, from the global state; delayed-scaling tensors made the
        first time a recipe is seen (TE: base.py:1327-1384)."""
        self.fp8 = FP8GlobalStateManager.is_fp8_enabled()
        if not self.fp8:
            return
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        meta = self.fp8_meta
        if not (self.fp8_initialized and meta.get("recipe") == recipe):
            meta["recipe"] = recipe
            if isinstance(recipe, DelayedScaling) and "scaling_fwd" not in meta:
                gemms = meta["num_gemms"]
                meta["scaling_fwd"] = DelayedScalingState.create(recipe, 3 * gemms, device)
                meta["scaling_bwd"] = DelayedScalingState.create(recipe, 2 * gemms, device)
            self.fp8_initialized = True
        meta["recipe"] = recipe
        meta["fp8_group"] = FP8GlobalStateManager.get_fp8_group()

    def delayed(self) -> bool:
        return self.fp8 and isinstance(self.fp8_meta.get("recipe"), DelayedScaling)

    def prepare_forward(self, inp: torch.Tensor) -> torch.Tensor:
        """TE: base.py:1386-1437. TE needs a device tensor (the simulated device counts as one)."""
        if self.fp8 and te_distributed.in_fp8_activation_recompute_phase():
            if self.delayed():
                FP8GlobalStateManager.get_old_fp8_meta_tensors_for_recompute(self.fp8_meta)
            return inp.contiguous()
        if inp.device.type == "cpu":
            raise RuntimeError(f"TransformerEngine needs CUDA. Got input on device: {inp.device}")
        if self.tp_size > 1 and self.tp_group is None:
            raise RuntimeError("Tensor parallel group not initialized. Call set_tensor_parallel_group() before "
                               "forward pass when tp_size > 1.")
        self.init_fp8_metadata(inp.device)
        if self.delayed():
            if self.sequence_parallel:
                assert self.fp8_meta["recipe"].reduce_amax, \
                    "Amax reduction across tensor parallel group is necessary when using sequence parallelism with FP8."
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(self.fp8_meta)
            if self.training and te_distributed.is_fp8_activation_recompute_enabled():
                FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute(self.fp8_meta)
        return inp.contiguous()

    def end_forward(self) -> None:
        """TE: base.py:1439-1446: after a recompute, the scales of before it come back."""
        if self.delayed() and te_distributed.in_fp8_activation_recompute_phase():
            FP8GlobalStateManager.restore_fp8_meta_tensors(self.fp8_meta)

    def get_extra_state(self) -> torch.Tensor:
        """The FP8 state a checkpoint keeps: empty without delayed scaling, else the amax history
        and scales, serialised into a uint8 tensor as TE does."""
        if "scaling_fwd" not in self.fp8_meta:
            return torch.empty(0, dtype=torch.uint8)
        state = {name: [self.fp8_meta[name].amax_history.cpu(), self.fp8_meta[name].scale.cpu()]
                 for name in ("scaling_fwd", "scaling_bwd")}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    def set_extra_state(self, state: Optional[torch.Tensor]) -> None:
        if state is None or state.numel() == 0:
            return
        loaded = torch.load(io.BytesIO(state.cpu().numpy().tobytes()), weights_only=True)
        for name, (history, scale) in loaded.items():
            if name in self.fp8_meta:
                self.fp8_meta[name].amax_history.copy_(history)
                self.fp8_meta[name].scale.copy_(scale)
