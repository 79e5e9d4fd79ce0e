"""TE's fused MoE router kernels: megatron-core imports them by name (TE ≥ 2.7); the double refuses their use."""


def _not_modelled(*args, **kwargs):
    raise NotImplementedError("the TE double does not model TE's MoE router kernels")


fused_compute_score_for_moe_aux_loss = fused_moe_aux_loss = fused_topk_with_score_function = _not_modelled
