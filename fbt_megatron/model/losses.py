"""The z-loss c·(log Σ_v exp logits_v)² per token, inside megatron-core's vocab-parallel cross-entropy.

The logits are sharded along the vocabulary over tensor-parallel ranks; log Σ exp is taken with the
all-reduced maximum and sum of exponentials (megatron-core's ``VocabParallelCrossEntropy`` steps,
reused), so every rank holds the whole-vocabulary value and its shard's gradient
∂(c·lse²)/∂logit_v = 2c·lse·softmax_v is exact.

As megatron-core does with its MoE auxiliary losses (``MoEAuxLossAutoScaler``), the z term enters
the *gradient* and not the *value*: the per-token loss keeps its cross-entropy value (so the
per-pass next-token losses stay comparable when the z-loss switches on), and its backward is that
of cross-entropy + z. Every reduction the token loss goes through afterwards (loss mask, pass
weights, microbatch mean, CP share, loss scale) applies to both terms alike. What the z term adds
to a step's loss is measured in that same backward: Σ_t (∂ step loss / ∂ token loss_t) · c·lse_t²
(``ZLoss.value``).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.parallel_state import (get_tensor_model_parallel_group, get_tensor_model_parallel_rank,
                                          get_tensor_model_parallel_world_size)
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.utils import VocabUtility

from fbt_megatron.common import platform


class ZLoss:
    """A model's z-loss: this step's coefficient (set at every step's start by the training loop,
    the same on all ranks) and the z term's share of the step's loss, summed in backward."""

    def __init__(self):
        self.coeff = 0.0
        self.total = torch.zeros((), device=platform.device())  # stays on the device: no host sync per backward

    def start_step(self, coeff: float) -> None:
        self.coeff = float(coeff)
        self.total.zero_()

    def value(self, config) -> torch.Tensor:
        """What the z term added to this rank's loss in this step (Σ_j w_j · mean c·lse² over the
        loss tokens of pass j, averaged over microbatches; a CP rank's share × cp, like the
        per-pass losses), without the loss scale the backward ran with."""
        one = torch.ones(1, device=self.total.device)
        scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
        return (self.total / scale).reshape(())


def z_loss_coefficient(training, cooldown_start: Optional[int], iteration: int) -> float:
    """c for the step with 0-based ``iteration``: ``training.z_loss_coeff`` from the first step
    (``z_loss_from: start``) or from the cooldown's first step on (none without a cooldown)."""
    if training.z_loss_from == "start":
        return training.z_loss_coeff
    return training.z_loss_coeff if cooldown_start is not None and iteration >= cooldown_start else 0.0


class _VocabParallelCrossEntropyZLoss(torch.autograd.Function):
    """Cross-entropy per token [s, b] from vocab-sharded logits [s, b, V/tp]; backward adds the
    z-loss gradient and accumulates the z term's contribution into ``total``."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, coeff: float, total: torch.Tensor):
        group = get_tensor_model_parallel_group()
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(vocab_parallel_logits)
        torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.size(-1), get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        )
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = VocabParallelCrossEntropy.calculate_predicted_logits(
            logits, target, logits_max, start, end
        )
        torch.distributed.all_reduce(predicted, group=group)
        torch.distributed.all_reduce(sum_exp, group=group)
        lse = torch.log(sum_exp) + logits_max  # log Σ_v exp logits_v over the whole vocabulary
        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.coeff, ctx.total = coeff, total
        ctx.save_for_backward(softmax, target_mask, masked_target_1d, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d, lse = ctx.saved_tensors
        c = ctx.coeff
        grad_2d, arange_1d, softmax_update, grad_input = VocabParallelCrossEntropy.prepare_gradient_calculation_operands(
            softmax, target_mask
        )
        grad_input.mul_((1.0 + 2.0 * c * lse).unsqueeze(-1))  # ∂(lse + c·lse²)/∂logits = (1 + 2c·lse)·softmax
        grad_input = VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output
        )
        ctx.total += (grad_output.float() * (c * lse.square())).sum()
        return grad_input, None, None, None


def vocab_parallel_cross_entropy_z(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, z_loss: ZLoss) -> torch.Tensor:
    """Per-token cross-entropy [s, b] of vocab-sharded logits [s, b, V/tp] (megatron-core's
    ``tensor_parallel.vocab_parallel_cross_entropy``), whose gradient also carries the z-loss
    ``z_loss.coeff``·lse²; its contribution to the loss is summed into ``z_loss`` in backward.
    Like megatron-core's, it overwrites fp32 logits in place."""
    return _VocabParallelCrossEntropyZLoss.apply(vocab_parallel_logits, target, z_loss.coeff, z_loss.total)
