"""TE's Linear (TE: pytorch/module/linear.py): a GEMM with TE's per-call state.

Per call: ``is_first_microbatch`` decides the FP8 weight cache (True or None: quantize the weight
again; False: reuse the copy the last True cached, linear.py:421-431, 1805) and, with
``fuse_wgrad_accumulation``, whether the weight gradient overwrites ``main_grad`` (True) or is
added to it (False or None, linear.py:1105-1110). Tensor parallelism as TE's ``parallel_mode``:
"column" gathers a sequence-parallel input (or copies it, its gradient all-reduced), "row"
reduce-scatters (sequence parallel) or all-reduces its output.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from megatron.core.tensor_parallel import mappings

from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule, device_of, get_dummy_wgrad
from transformer_engine.pytorch.quantization import FP8GlobalStateManager, current_scale, fake_quantize, fp8_max
from transformer_engine.pytorch import distributed as te_distributed

UNMODELLED = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_wgrad", "ub_bulk_dgrad",
              "delay_wgrad_compute", "symmetric_ar_type")


def refuse_unmodelled(kwargs: dict) -> None:
    """Arguments TE takes that the double does not model: refused when they ask for something."""
    asked = sorted(k for k in UNMODELLED if kwargs.get(k))
    if asked:
        raise NotImplementedError(f"the TE double does not model {', '.join(asked)}")


def quantize(module, tensor: torch.Tensor, slot: int, forward: bool) -> torch.Tensor:
    """``tensor`` as the FP8 GEMM reads it (float32 values): the module's delayed-scaling scale of
    ``slot``, or current scaling's own scale."""
    recipe = module.fp8_meta["recipe"]
    maximum = fp8_max(recipe, forward)
    if isinstance(recipe, DelayedScaling):
        state = module.fp8_meta["scaling_fwd" if forward else "scaling_bwd"]
        return state.quantize(tensor.float(), slot, maximum)
    return fake_quantize(tensor.float(), current_scale(tensor, maximum), maximum)


def _first_module_reduces_backward() -> bool:
    """TE: linear.py:240-247 (the flag kept for a recompute's later modules)."""
    state = FP8GlobalStateManager.quantization_state
    first = state.is_first_fp8_module
    result = FP8GlobalStateManager.is_first_fp8_module()
    if te_distributed.in_fp8_activation_recompute_phase():
        state.is_first_fp8_module = first
    return result


class _GEMM(torch.autograd.Function):
    """y = x Wᵀ; backward: dx = dy W, dW = dyᵀ x, each GEMM reading FP8 values under FP8."""

    @staticmethod
    def forward(ctx, inp, weight, module, is_first_microbatch):
        fp8 = module.fp8
        if fp8:
            if module.save_original_input:
                assert not isinstance(module.fp8_meta["recipe"], DelayedScaling), \
                    "DelayedScaling recipe is not supported with save_original_input"  # TE: linear.py:323-326
            x = quantize(module, inp, 0, forward=True)
            w = module.fp8_weight(weight, is_first_microbatch)
        else:
            x, w = inp, weight.to(inp.dtype)
        out = (x.float() @ w.float().t()).to(inp.dtype)
        # the input kept for the weight gradient: quantized, or the original, quantized again in backward
        ctx.save_for_backward(inp if module.save_original_input else x, w)
        ctx.requantize = fp8 and module.save_original_input
        ctx.module, ctx.weight, ctx.fp8, ctx.dtype = module, weight, fp8, inp.dtype
        ctx.is_first_microbatch = is_first_microbatch
        ctx.reduce_backward = fp8 and torch.is_grad_enabled() and _first_module_reduces_backward()
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        module, weight = ctx.module, ctx.weight
        if ctx.requantize:
            x = quantize(module, x, 0, forward=True)
        g = quantize(module, grad, 0, forward=False) if ctx.fp8 else grad
        dgrad = (g.float() @ w.float()).to(ctx.dtype)
        wgrad = g.float().t() @ x.float() if ctx.needs_input_grad[1] else None
        if wgrad is not None:
            wgrad = module.weight_gradient(weight, wgrad, ctx.is_first_microbatch)
        if ctx.reduce_backward:
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return dgrad, wgrad, None, None


class Linear(TransformerEngineBaseModule):
    """TE's Linear with the arguments megatron-core's TELinear passes."""

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True, return_bias: bool = False,
                 parallel_mode: Optional[str] = None, params_dtype=None, device="cuda", save_original_input: bool = False,
                 **kwargs):
        super().__init__()
        self.save_original_input = save_original_input
        refuse_unmodelled(kwargs)
        if bias:
            raise NotImplementedError("the TE double models linears without bias (the FBT model has none)")
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"parallel_mode {parallel_mode!r}")
        self.in_features, self.out_features, self.use_bias, self.return_bias = in_features, out_features, bias, return_bias
        self.sequence_parallel, self.fuse_wgrad_accumulation = sequence_parallel, fuse_wgrad_accumulation
        self.tp_group, self.tp_size, self.parallel_mode = tp_group, tp_size, parallel_mode
        local_out = out_features // tp_size if parallel_mode == "column" else out_features
        local_in = in_features // tp_size if parallel_mode == "row" else in_features
        self.weight = torch.nn.Parameter(torch.empty(local_out, local_in, dtype=params_dtype or torch.float32,
                                                     device=device_of(device)))
        if parallel_mode in ("column", "row"):
            self.weight.tensor_model_parallel, self.weight.partition_dim = True, 0 if parallel_mode == "column" else 1
            self.weight.partition_stride = 1
        self.initialize(self.weight, init_method, get_rng_state_tracker, rng_tracker_name)
        self._fp8_workspaces = {}

    @staticmethod
    def initialize(weight, init_method, get_rng_state_tracker, rng_tracker_name) -> None:
        """TE: each rank initialises its own shard inside the model-parallel RNG tracker's fork."""
        init = init_method or (lambda w: torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5)))
        if get_rng_state_tracker is None:
            init(weight.data)
            return
        with get_rng_state_tracker().fork(*(() if rng_tracker_name is None else (rng_tracker_name,))):
            init(weight.data)

    def fp8_weight(self, weight: torch.Tensor, is_first_microbatch: Optional[bool]) -> torch.Tensor:
        """The weight as the FP8 GEMM reads it: quantized again when ``is_first_microbatch`` is
        True or None, else the cached copy (TE's workspace, kept only when the flag is not None)."""
        cache = is_first_microbatch is not None
        if cache and not is_first_microbatch and "weight" in self._fp8_workspaces:
            return self._fp8_workspaces["weight"]
        quantized = quantize(self, weight.detach(), 1, forward=True)
        if cache:
            self._fp8_workspaces["weight"] = quantized
        return quantized

    def weight_gradient(self, weight, wgrad: torch.Tensor, is_first_microbatch: Optional[bool]):
        """What autograd receives for the weight. Fused: the GEMM writes ``main_grad`` itself —
        overwriting it when the forward saw ``is_first_microbatch=True``, adding otherwise (TE:
        linear.py:1105-1110, 1130-1136) — and autograd gets a dummy (:1220-1234)."""
        if not self.fuse_wgrad_accumulation:
            return wgrad.to(weight.dtype)
        accumulate = not is_first_microbatch if is_first_microbatch is not None else True
        main_grad = weight.main_grad
        if accumulate:
            main_grad.add_(wgrad.to(main_grad.dtype))
        else:
            main_grad.copy_(wgrad.to(main_grad.dtype))
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        weight.grad_added_to_main_grad = True
        return get_dummy_wgrad(list(main_grad.shape), weight.dtype, zero=getattr(weight, "zero_out_wgrad", False))

    def gemm_input(self, inp: torch.Tensor) -> torch.Tensor:
        """A column-parallel GEMM's input: gathered along the sequence (SP) or copied to the TP ranks."""
        if self.parallel_mode == "column" and self.tp_size > 1:
            if self.sequence_parallel:
                return mappings.gather_from_sequence_parallel_region(inp, group=self.tp_group)
            return mappings.copy_to_tensor_model_parallel_region(inp, group=self.tp_group)
        return inp

    def gemm_output(self, out: torch.Tensor) -> torch.Tensor:
        """A row-parallel GEMM's output: reduce-scattered along the sequence (SP) or all-reduced."""
        if self.parallel_mode == "row" and self.tp_size > 1:
            if self.sequence_parallel:
                return mappings.reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
            return mappings.reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out

    def gemm(self, inp: torch.Tensor, is_first_microbatch: Optional[bool]) -> torch.Tensor:
        x = self.gemm_input(inp)
        out = _GEMM.apply(x.reshape(-1, x.shape[-1]), self.weight, self, is_first_microbatch)
        return self.gemm_output(out.view(*x.shape[:-1], -1))

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, **kwargs):
        if kwargs:
            raise NotImplementedError(f"the TE double does not model Linear.forward({', '.join(kwargs)})")
        inp = self.prepare_forward(inp)
        out = self.gemm(inp, is_first_microbatch)
        self.end_forward()
        return (out, torch.empty(0, dtype=out.dtype, device=out.device)) if self.return_bias else out
