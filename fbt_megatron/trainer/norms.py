"""Each layer's parameter and gradient norms (``--log-layer-norms-interval N``): Megatron-LM's
``--log-params-norm`` per layer, for every N-th step's record (``param_norms`` / ``grad_norms``,
TensorBoard and W&B tags ``params-norm/NAME`` / ``grad-norm/NAME``).

A layer is a transformer layer by its global number (``decoder.layers.I``, I from 0, whichever
pipeline stage holds it); any other parameter is its module (``embedding.word_embeddings``,
``decoder.final_layernorm``, ...). The norms are of the whole model, whatever the layout: every
rank sums the squares of what only it holds — its shard of a tensor-parallel weight, a parameter
duplicated over the TP ranks (a norm's weight) on TP rank 0 only, a replica over data- and
context-parallel ranks on one of them, a tied output weight not at all (its embedding counts), and
of the gradient its shard of the distributed optimizer's reduce-scatter — and the sums meet in one
gather over all ranks. Gradients are the reduced ones the optimizer is about to use: before
clipping, unscaled (fp16), as Megatron-LM's ``grad-norm`` (``gradient_squares``, before the step);
parameters are the step's result (``layer_norms``, after it; every rank calls it).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import torch.distributed as dist

_LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)\.")


def layer_names(model) -> dict:
    """Parameter → its layer's name (module docstring)."""
    numbers = {name: m.layer_number for name, m in model.named_modules()
               if hasattr(m, "layer_number") and re.fullmatch(r".*decoder\.layers\.\d+", name)}
    out = {}
    for name, param in model.named_parameters():
        m = _LAYER.match(name)
        if m:
            local = m.group(1) + m.group(2)
            out[param] = f"{m.group(1)}{numbers.get(local, int(m.group(2)) + 1) - 1}"
        else:
            out[param] = name.rsplit(".", 1)[0]
    return out


def _gradient_shards(ddp) -> dict:
    """Parameter → the part of its reduced gradient this rank holds, where DDP reduce-scatters
    gradients for the distributed optimizer (each rank holds one shard of every bucket); {} else."""
    out = {}
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        if not buffer.ddp_config.use_distributed_optimizer:
            continue
        size, rank = buffer.data_parallel_group.size(), buffer.data_parallel_group.rank()
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            bucket = buffer.buckets[bucket_id]
            shard = bucket.grad_data.numel() // size
            lo, hi = max(start - bucket.offset, rank * shard), min(end - bucket.offset, (rank + 1) * shard)
            out[param] = bucket.grad_data[lo:hi] if lo < hi else None
    return out


def _counted(model):
    """(parameter, its layer, whether this rank counts it: not a data- or context-parallel replica)
    for the parameters that are neither a tied copy nor a duplicate over the TP ranks (module docstring)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    replica = parallel_state.get_data_parallel_rank(with_context_parallel=True) != 0
    for param, name in layer_names(model).items():
        if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
            yield param, name, not replica


def gradient_squares(model, ddp, loss_scale: float = 1.0) -> dict:
    """This rank's part of each layer's squared gradient norm: after the gradients are reduced,
    before the optimizer step (which may clip them in place); unscaled by ``loss_scale`` (fp16)."""
    shards, out = _gradient_shards(ddp), defaultdict(float)
    for param, name, mine in _counted(model):
        grad = shards[param] if param in shards else (getattr(param, "main_grad", param.grad) if mine else None)
        if grad is not None:
            out[name] += float(grad.detach().double().square().sum()) / loss_scale ** 2
    return dict(out)


def layer_norms(model, gradients: dict) -> dict:
    """{"param_norms": {layer: ‖θ‖}, "grad_norms": {layer: ‖g‖}} of the whole model (module
    docstring): the weights as they are now (after the step), the gradients of ``gradient_squares``.
    A collective: every rank calls it."""
    params = defaultdict(float)
    for param, name, mine in _counted(model):
        if mine:
            params[name] += float(param.detach().double().square().sum())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"param_norms": dict(params), "grad_norms": gradients})
    total = {"param_norms": defaultdict(float), "grad_norms": defaultdict(float)}
    for other in gathered:
        for kind, sums in other.items():
            for name, value in sums.items():
                total[kind][name] += value
    return {kind: {name: math.sqrt(v) for name, v in sorted(sums.items(), key=lambda kv: _order(kv[0]))}
            for kind, sums in total.items()}


def _order(name: str) -> tuple:
    """Layers in their order (decoder.layers.2 before decoder.layers.10), the other modules by name."""
    m = re.match(r"^(.*decoder\.layers\.)(\d+)$", name)
    return (m.group(1), int(m.group(2))) if m else (name, -1)
