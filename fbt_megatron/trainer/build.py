"""The model and the optimizer of a training run, built from its recipe.

The model is this pipeline stage's ``FBTModel`` with the recipe's config (``config.recipe_config``:
the preset, the model overrides, the parallel layout and the precision) in megatron-core DDP
(``parallel.data``); the optimizer is ``fbt_megatron.optimizers``' with its learning-rate scheduler
(``optimizers.schedule``).
"""

from __future__ import annotations

from typing import Optional

import torch

from fbt_megatron import optimizers
from fbt_megatron.common import platform
from fbt_megatron.distributed import data_parallel, pipeline
from fbt_megatron.model.config import recipe_config
from fbt_megatron.model.fbt_model import FBTModel, fbt_model_spec
from fbt_megatron.optimizers.schedule import build_scheduler, lr_schedule
from fbt_megatron.recipe import Recipe

# the parallel layout: fields of the recipe's parallel section and of the model's config alike
LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel", "context_parallel_size")


def build_model(recipe: Recipe, vocab_size: int):
    """(config, model, ddp): this pipeline stage's FBTModel in megatron-core DDP (gradient buffers,
    reduction over data-parallel ranks)."""
    o, p = recipe.optimizer, recipe.parallel
    shards_gradients = optimizers.ddp_shards_gradients(recipe)
    dtype = torch.bfloat16 if o.bf16 else torch.float16 if o.fp16 else torch.float32
    layout = {name: getattr(p, name) for name in LAYOUT}
    config = recipe_config(recipe, vocab_size, **layout, bf16=o.bf16, fp16=o.fp16, params_dtype=dtype,
                           gradient_accumulation_fusion=recipe.model_overrides.get(  # into DDP's main_grad
                               "gradient_accumulation_fusion", platform.gradient_accumulation_fusion()))
    spec = fbt_model_spec(config, local_attention=recipe.data.sft)  # packed SFT rows: an explicit attention mask
    model = FBTModel(config, spec, **pipeline.stage()).to(device=platform.device(), dtype=dtype)
    ddp = data_parallel.wrap(config, model, p.overlap_grad_reduce, shards_gradients)
    return config, model, ddp


def build_optimizer(recipe: Recipe, config, ddp, schedule: Optional[dict] = None):
    """The run's optimizer (``fbt_megatron.optimizers``: megatron-core's Adam or SGD with weight
    decay off for norms and 1-D parameters, or NorMuon for the matrices + Adam for the rest) and
    its learning-rate scheduler following ``schedule`` (default: the recipe's, ``lr_schedule``)."""
    optimizer = optimizers.build_optimizer(recipe, config, ddp)
    config.grad_scale_func = optimizer.scale_loss
    return optimizer, build_scheduler(optimizer, schedule or lr_schedule(recipe))
