"""A CPU double of Apex's ``fused_weight_gradient_mlp_cuda`` (apex/csrc/megatron/fused_weight_gradient_dense.cpp):
megatron-core's own linears under ``gradient_accumulation_fusion`` (here the headwise gate) add
their weight gradient, dyᵀ x, into ``main_grad`` — always adding, never overwriting."""

import torch


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    main_grad.add_(grad_output.float().t() @ total_input.float())


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    main_grad.add_((grad_output.t() @ total_input).to(main_grad.dtype))
