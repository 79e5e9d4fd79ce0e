"""The optimizers of a training run: megatron-core's Adam/SGD, or NorMuon + Adam (the paper's).

``--optimizer normuon`` splits the parameters:

* **NorMuon** (``--lr``, paper 1e-2; ``--weight-decay``, paper 0.01): the 2-D weight matrices of
  attention (``linear_qkv`` — orthogonalised per Q, K, V — and ``linear_proj``), of the MLP
  (``linear_fc1``, ``linear_fc2``) and of the feedback fusion (W_U ``linear_state``, W_G
  ``linear_gate``).
* **Adam** (``--adam-lr``, paper 5e-4; no weight decay): the embedding and output layer, every
  norm, the attention's headwise gate (``self_attention.linear_gate``), every 1-D parameter and
  the names matching ``--adam-params`` globs.

NorMuon is ``normuon.NorMuon`` in megatron-core's FP32/Float16 wrappers; Adam is megatron-core's,
built by ``get_megatron_optimizer`` with the NorMuon matrices frozen (megatron-core's ``muon.py``
does the same), and both run as one ``ChainedOptimizer`` (one gradient clip over both). With
``--use-distributed-optimizer`` (the default) megatron-core's ``LayerWiseDistributedOptimizer``
(``layer_wise``: with a gloo-safe all-gather) gives every parameter to one data-parallel rank,
which alone holds its optimizer state and updates it, then all-gathers the weights; DDP then
all-reduces whole gradients.

``schedule.WeightDecayScheduler`` is megatron-core's learning-rate scheduler with per-family peaks
(NorMuon at ``--lr``, Adam at ``--adam-lr``) and AdamC weight decay in the cooldown.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.recipe import Recipe

HEADWISE_GATE = "*self_attention.linear_gate.weight"


def uses_normuon(name: str, param: torch.Tensor, adam_params=()) -> bool:
    """Whether NorMuon updates this parameter (see the module docstring); else Adam does."""
    return (
        param.dim() == 2
        and not getattr(param, "is_embedding_or_output_parameter", False)
        and not any(fnmatch.fnmatchcase(name, pattern) for pattern in (HEADWISE_GATE, *adam_params))
    )


def optimizer_config(recipe: Recipe, config):
    """megatron-core's OptimizerConfig for the recipe (Adam's settings under normuon)."""
    from megatron.core.optimizer import OptimizerConfig

    o = recipe.optimizer
    return OptimizerConfig(
        optimizer="adam" if o.optimizer == "normuon" else o.optimizer,
        lr=o.lr if o.optimizer != "normuon" or o.adam_lr is None else o.adam_lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        sgd_momentum=o.sgd_momentum,
        clip_grad=o.clip_grad,
        bf16=o.bf16,
        fp16=o.fp16,
        loss_scale=o.loss_scale,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=recipe.parallel.use_distributed_optimizer and o.optimizer != "normuon",
    )


def ddp_shards_gradients(recipe: Recipe) -> bool:
    """Whether DDP reduce-scatters gradients for megatron-core's distributed optimizer (NorMuon's
    layer-wise ownership needs whole gradients)."""
    return recipe.parallel.use_distributed_optimizer and recipe.optimizer.optimizer != "normuon"


def build_optimizer(recipe: Recipe, config, ddp):
    """The run's optimizer over ``ddp``'s parameters (a megatron-core MegatronOptimizer)."""
    from megatron.core.optimizer import get_megatron_optimizer

    if recipe.optimizer.optimizer != "normuon":
        return get_megatron_optimizer(optimizer_config(recipe, config), [ddp])
    return _normuon_and_adam(recipe, config, ddp)


def _normuon_and_adam(recipe: Recipe, config, ddp):
    from megatron.core import parallel_state
    from megatron.core.optimizer import ChainedOptimizer, get_megatron_optimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from megatron.core.process_groups_config import ProcessGroupCollection

    from fbt_megatron.optimizers.checkpoint import NestedFP32Optimizer, NorMuonFloat16Optimizer, NorMuonFP32Optimizer
    from fbt_megatron.optimizers.layer_wise import LayerWiseOptimizer
    from fbt_megatron.optimizers.normuon import NorMuon

    o, layer_wise = recipe.optimizer, recipe.parallel.use_distributed_optimizer
    if o.fp16:
        raise RecipeError("optimizer.optimizer normuon does not support fp16 (use bf16)")
    named = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
    matrices = [(n, p) for n, p in named if uses_normuon(n, p, o.adam_params)]
    mc = ddp.module.config
    qkv_shapes = [mc.num_attention_heads // mc.num_query_groups * mc.kv_channels, mc.kv_channels, mc.kv_channels]
    for name, p in matrices:
        p.is_qkv = name.endswith("linear_qkv.weight")
    group = dict(params=[p for _, p in matrices], max_lr=o.lr, min_lr=o.min_lr,  # megatron's group keys
                 wd_mult=1.0, lr_mult=1.0, is_expert_parallel=False, is_decoupled_lr=False)
    normuon = NorMuon(
        [group], lr=o.lr, momentum=o.muon_momentum, beta2=o.normuon_beta2, weight_decay=o.weight_decay,
        num_ns_steps=o.muon_num_ns_steps, qkv_split_shapes=qkv_shapes if o.muon_split_qkv else None,
        tp_group=parallel_state.get_tensor_model_parallel_group(), tp_mode=o.muon_tp_mode,
    )
    adam_config = optimizer_config(recipe, config)

    def init_state(optimizer, _config=None):
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.init_state(p)


    def wrap_normuon(optimizer):
        if not o.bf16:
            return NorMuonFP32Optimizer(optimizer, adam_config, init_state)
        wrapper = NorMuonFloat16Optimizer(optimizer, adam_config, None, init_state)
        for model_params, main_params in zip(wrapper.float16_groups, wrapper.fp32_from_float16_groups):
            for p, main in zip(model_params, main_params):
                main.is_qkv = p.is_qkv
        return wrapper

    # Adam for the rest: megatron-core's, with the matrices frozen. Under layer-wise ownership its
    # bf16 wrapper (fp32 main weights) is made after the parameters are shared out, as megatron-core's
    # muon.py does, so that a rank keeps main weights only for the parameters it owns.
    for _, p in matrices:
        p.requires_grad = False
    try:
        adam = get_megatron_optimizer(dataclasses.replace(adam_config, bf16=adam_config.bf16 and not layer_wise), [ddp])
    finally:
        for _, p in matrices:
            p.requires_grad = True
    for adam_group in adam.param_groups:  # no weight decay (the scheduler reads the group's own)
        adam_group["start_wd"] = adam_group["end_wd"] = 0.0
    adams = getattr(adam, "chained_optimizers", [adam])
    if not layer_wise:
        return ChainedOptimizer([wrap_normuon(normuon), *adams])

    def wrap_adam(optimizer, init_state_fn):
        if o.bf16:
            return Float16OptimizerWithFloat16Params(optimizer, adam_config, None, init_state_fn)
        return NestedFP32Optimizer(optimizer, adam_config, init_state_fn)

    wrappers = [wrap_normuon, *(lambda opt, fn=a.init_state_fn: wrap_adam(opt, fn) for a in adams)]
    pg = ProcessGroupCollection.use_mpu_process_groups()
    return LayerWiseOptimizer([normuon, *(a.optimizer for a in adams)], wrappers, pg)


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer state tensors this rank holds (moments, main weights excluded)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(t.numel() * t.element_size() for opt in inner for state in opt.optimizer.state.values()
               for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
