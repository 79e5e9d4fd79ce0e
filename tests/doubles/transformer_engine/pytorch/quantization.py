"""FP8 state and quantization (TE: pytorch/quantization.py).

The process-global state (``FP8GlobalStateManager``): whether FP8 is on, the recipe and amax
reduction group of the innermost autocast, the autocast depth, the delayed-scaling buffers of every
module that registered in an autocast (each module once), and the recompute stash. Quantization is
emulated: a tensor is scaled, saturated to the format's maximum and cast to torch's float8 dtype
(round to nearest even), then cast back and unscaled, so the GEMMs see exactly the values an FP8
GEMM would multiply (with FP32 accumulation).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, Recipe

# the simulated GPU is an H100 (sm90): FP8 yes, MXFP8 no (TE: quantization.py:149-170)
DEVICE_COMPUTE_CAPABILITY = (9, 0)
_FP8_DTYPES = {448: torch.float8_e4m3fn, 57344: torch.float8_e5m2}


def fp8_max(recipe: Recipe, forward: bool) -> float:
    """The format's largest value for forward tensors (inputs, weights) or gradients (TE: get_fp8_max)."""
    return recipe.fp8_format.value.max_fwd if forward else recipe.fp8_format.value.max_bwd


def fake_quantize(tensor: torch.Tensor, scale: torch.Tensor, maximum: float) -> torch.Tensor:
    """What an FP8 GEMM reads of ``tensor`` quantized with ``scale``: cast(tensor·scale) / scale,
    saturated at ±maximum as TE's casts are (``satfinite``); E4M3 for 448, E5M2 for 57344."""
    scaled = (tensor.float() * scale).clamp(-maximum, maximum)
    return (scaled.to(_FP8_DTYPES[maximum]).float() / scale).to(tensor.dtype)


def current_scale(tensor: torch.Tensor, maximum: float) -> torch.Tensor:
    """Current scaling's scale: maximum / amax of this very tensor, 1 where the amax is 0
    (TE's Float8CurrentScalingQuantizer, amax_epsilon 0, no power-of-2 rounding by default)."""
    amax = tensor.detach().abs().max().float()
    return torch.where(amax > 0, maximum / amax, torch.ones_like(amax))


@dataclass
class DelayedScalingState:
    """One module's delayed-scaling tensors for forward (input, weight, output per GEMM) or
    backward (grad output, grad input): an amax history [length, slots] and scales [slots]."""

    amax_history: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def create(cls, recipe: DelayedScaling, slots: int, device) -> "DelayedScalingState":
        return cls(torch.zeros(recipe.amax_history_len, slots, device=device), torch.ones(slots, device=device))

    def quantize(self, tensor: torch.Tensor, slot: int, maximum: float) -> torch.Tensor:
        """Quantize with the current scale and record the amax: a running maximum since the last
        update (the cast kernel's atomicMaxFloat into amax_history[0], TE:
        common/cast/fp8/quantize_fp8.cuh:223)."""
        amax = tensor.detach().abs().max().float().to(self.amax_history.device)
        self.amax_history[0, slot] = torch.maximum(self.amax_history[0, slot], amax)
        return fake_quantize(tensor, self.scale[slot], maximum)

    def update(self, recipe: DelayedScaling, maximum: float) -> None:
        """The amax from the history ('max' or 'most_recent'), the history rolled and its newest
        row zeroed, scale = maximum / amax / 2^margin where the amax is positive and finite
        (TE: quantization.py:1043-1143)."""
        history = self.amax_history
        amax = history.max(dim=0).values if recipe.amax_compute_algo == "max" else history[0].clone()
        if history.shape[0] > 1:
            history.copy_(torch.roll(history, -1, 0))
        history[0].fill_(0.0)
        new = (maximum / amax) / (2 ** recipe.margin)
        new = torch.where((amax > 0) & torch.isfinite(amax), new, self.scale)
        self.scale.copy_(torch.where(torch.isinf(new), torch.full_like(new, torch.finfo(torch.float32).max), new))


def recipe_key(recipe: Recipe, group) -> str:
    """An autocast's identity: the recipe's value and the group's object (TE: get_unique_autocast_key)."""
    return f"recipe={recipe!r},group={id(group) if group is not None else None}"


@dataclass
class FP8GlobalState:
    fp8_enabled: bool = False
    fp8_recipe: Optional[Recipe] = None
    fp8_group: object = None
    is_first_fp8_module: bool = False
    autocast_depth: int = 0
    # (forward, autocast key) → the registered modules' states, in registration order
    buffers: Dict[Tuple[bool, str], List[DelayedScalingState]] = field(default_factory=dict)
    autocast_arguments: Dict[str, Tuple[Recipe, object]] = field(default_factory=dict)
    recompute_stash: List[deque] = field(default_factory=list)


class FP8GlobalStateManager:
    """The global FP8 state (TE: quantization.py:405-821)."""

    quantization_state = FP8GlobalState()

    @classmethod
    def reset(cls) -> None:
        cls.quantization_state = FP8GlobalState()

    @classmethod
    def is_fp8_available(cls) -> Tuple[bool, str]:
        return True, ""

    @classmethod
    def is_mxfp8_available(cls) -> Tuple[bool, str]:
        return DEVICE_COMPUTE_CAPABILITY >= (10, 0), "MXFP8 (for all gemms) is only supported on Blackwell architecture."

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.quantization_state.fp8_enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return False

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return False

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return False

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        return cls.quantization_state.fp8_recipe or DelayedScaling()

    @classmethod
    def get_fp8_group(cls):
        return cls.quantization_state.fp8_group

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True once per outermost autocast: for the module whose backward runs last, which then
        reduces the backward amaxes (TE: quantization.py:574-581)."""
        first, cls.quantization_state.is_first_fp8_module = cls.quantization_state.is_first_fp8_module, False
        return first

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: dict) -> None:
        """A delayed-scaling module joins its autocast's reduction, once in its life: the first
        autocast it runs in decides its buffer (TE: quantization.py:477-541)."""
        if "global_buffer_registered" in fp8_meta:
            return
        fp8_meta["global_buffer_registered"] = True
        key = recipe_key(fp8_meta["recipe"], fp8_meta["fp8_group"])
        for forward, name in ((True, "scaling_fwd"), (False, "scaling_bwd")):
            cls.quantization_state.buffers.setdefault((forward, key), []).append(fp8_meta[name])

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """Every registered module's newest amaxes reduced (MAX) over the autocast's group, then
        its history and scales updated (TE: quantization.py:632-688)."""
        state = cls.quantization_state
        for (is_forward, key), modules in state.buffers.items():
            if is_forward != forward or not modules:
                continue
            recipe, group = state.autocast_arguments[key]
            amaxes = torch.stack([m.amax_history[0] for m in modules])
            if recipe.reduce_amax and torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
            for module, amax in zip(modules, amaxes):
                module.amax_history[0].copy_(amax)
                module.update(recipe, fp8_max(recipe, forward))

    @classmethod
    def get_autocast_state(cls) -> tuple:
        s = cls.quantization_state
        return s.fp8_enabled, s.fp8_recipe, s.fp8_group, s.is_first_fp8_module

    @classmethod
    def set_autocast_state(cls, saved: tuple) -> None:
        s = cls.quantization_state
        s.fp8_enabled, s.fp8_recipe, s.fp8_group, s.is_first_fp8_module = saved

    @classmethod
    def autocast_enter(cls, enabled: bool, recipe: Optional[Recipe], group) -> None:
        """TE: quantization.py:706-746 (MXFP8 asserts on an H100; the double refuses what it does not model)."""
        recipe = DelayedScaling() if recipe is None else recipe
        state = cls.quantization_state
        state.autocast_arguments[recipe_key(recipe, group)] = (recipe, group)
        state.fp8_enabled, state.fp8_recipe, state.fp8_group = enabled, recipe, group
        if state.autocast_depth == 0:
            state.is_first_fp8_module = True
        state.autocast_depth += 1
        if enabled:
            if isinstance(recipe, MXFP8BlockScaling):
                available, reason = cls.is_mxfp8_available()
                assert available, reason
            if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
                raise NotImplementedError(f"the TE double models delayed and current (tensorwise) scaling, not {recipe!r}")

    @classmethod
    def autocast_exit(cls, enabled: bool) -> None:
        """Forward amaxes are reduced and scales updated only when the outermost autocast exits with
        grad enabled (TE: quantization.py:748-756)."""
        state = cls.quantization_state
        state.autocast_depth -= 1
        if enabled and state.autocast_depth == 0 and torch.is_grad_enabled():
            cls.reduce_and_update_fp8_tensors(forward=True)

    @classmethod
    def copy_forward_fp8_meta_tensors_for_recompute(cls, fp8_meta: dict) -> None:
        """First forward of a checkpointed region: stash this module's forward amax history and
        scale for its recompute, one FIFO per module (TE: quantization.py:761-787)."""
        stash = cls.quantization_state.recompute_stash
        saved = [fp8_meta["scaling_fwd"].amax_history.clone(), fp8_meta["scaling_fwd"].scale.clone()]
        if "recompute_position" not in fp8_meta:
            stash.append(deque())
            fp8_meta["recompute_position"] = len(stash) - 1
        stash[fp8_meta["recompute_position"]].append(saved)

    @classmethod
    def get_old_fp8_meta_tensors_for_recompute(cls, fp8_meta: dict) -> None:
        """Recompute: keep the current tensors aside and run with the oldest stashed ones (popleft,
        TE: quantization.py:789-810); a module never stashed has no position (a KeyError, as in TE)."""
        current = fp8_meta["scaling_fwd"]
        fp8_meta["updated"] = (current.amax_history.clone(), current.scale.clone())
        history, scale = cls.quantization_state.recompute_stash[fp8_meta["recompute_position"]].popleft()
        current.amax_history.copy_(history)
        current.scale.copy_(scale)

    @staticmethod
    def restore_fp8_meta_tensors(fp8_meta: dict) -> None:
        history, scale = fp8_meta.pop("updated")
        fp8_meta["scaling_fwd"].amax_history.copy_(history)
        fp8_meta["scaling_fwd"].scale.copy_(scale)


class autocast:
    """FP8 region (TE: quantization.py:948-1041): the state saved at entry and restored at exit."""

    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
                 amax_reduction_group=None, _graph: bool = False):
        if calibrating or _graph:
            raise NotImplementedError("the TE double does not model FP8 calibration or CUDA graphs")
        self.enabled, self.recipe, self.group, self.saved = enabled, recipe, amax_reduction_group, None

    def __enter__(self):
        self.saved = FP8GlobalStateManager.get_autocast_state()
        FP8GlobalStateManager.autocast_enter(self.enabled, self.recipe, self.group)
        return self

    def __exit__(self, *exc):
        FP8GlobalStateManager.set_autocast_state(self.saved)
        FP8GlobalStateManager.autocast_exit(self.enabled)


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group=None, _graph: bool = False) -> autocast:
    """The deprecated spelling megatron-core 0.16 uses (TE: quantization.py:917-945)."""
    return autocast(enabled, calibrating, fp8_recipe, fp8_group, _graph)


def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None, preserve_high_precision_init_val: bool = False):
    raise NotImplementedError("the TE double does not model FP8 parameters (fp8_param)")


def is_fp8_available(return_reason: bool = False):
    return (True, "") if return_reason else True


__all__ = ["Format", "autocast", "fp8_autocast", "fp8_model_init", "FP8GlobalStateManager", "fake_quantize"]
