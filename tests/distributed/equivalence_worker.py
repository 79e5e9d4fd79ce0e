"""Worker of the parallel-equivalence tests, launched as forked ranks (tests/forked.py): the parallel layouts of its world
size in turn (``--layouts``: one launch pays the interpreter and process-group start-up once).

For each layout it builds the training run of ``recipes/tiny_cpu.yaml`` (shrunk; the layout's flags
are the entry point's own overrides, e.g. ``--tensor-model-parallel-size 2``) through the training
module's own functions, loads the weights of a seed checkpoint, and for every recompute mode and every
k ∈ {1, 2, 3} runs two optimizer steps of k passes on the same global batches. It writes:
  <out>/losses.json                    per (mode, k): the per-pass losses of both steps
  <out>/deltas.json                    per (mode, k): ‖Δs‖ = RMS of s^{(j)} − s^{(j−1)}, j = 2..k, of both steps
  <out>/<mode>_k<k>                    one checkpoint: under ``grads.`` the first step's reduced
                                       gradients, under ``params.`` the weights after the second step
  <out>/overlap.json                   per (mode, k): where the second step's reductions started
  <out>/offload.json                   per rank: its pipeline stage, layers, and per (mode, k) the bytes
                                       offloaded to host memory and the calls of its first layer (forwards
                                       and recomputes) over the two steps
Checkpoints are megatron-core dist_checkpointing ones, so the test reads every layout's at
TP=PP=1 and compares tensor by tensor. ``--create-seed`` (one process) writes the seed first.
"""

import argparse
import json
from pathlib import Path

import torch

RECOMPUTE = {
    "none": {},
    "passes": {"recompute_passes": True},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective"},  # megatron-core's core-attention recompute
    "offload": {"recompute_passes": True, "offload_recompute_inputs": True, "min_offloaded_tensor_size": 0},
    "full_offload": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
                     "offload_recompute_inputs": True, "min_offloaded_tensor_size": 0},
}
SHRINK = [
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
    "--lr-warmup-iters", "0", "--adam-eps", "1", "--lr", "0.3", "--eval-iters", "0", "--tensorboard", "false", "--corpus", "null",
]


def full_gradients(ddp):
    """The reduced gradients, whole on every rank: with the distributed optimizer each DP rank
    holds only its reduced shard of every bucket, so gather the shards."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if ddp.ddp_config.use_distributed_optimizer and size > 1:
        for buffer in ddp.buffers:
            for bucket in buffer.buckets:
                shards = list(bucket.grad_data.chunk(size))
                dist.all_gather(shards, shards[rank].clone(), group=group)
    return {name: p.main_grad for name, p in ddp.module.named_parameters()}


def record_launches(ddp) -> list:
    """For every bucket collective started, whether it started inside backward (overlapped with
    it: megatron-core launches from gradient hooks) or after it (in finish_grad_sync)."""
    launches = []
    for group in ddp.bucket_groups:
        def start(*args, _start=group.start_grad_sync, **kwargs):
            launches.append(torch._C._current_graph_task_id() != -1)
            return _start(*args, **kwargs)

        group.start_grad_sync = start
    return launches


def save_tensors(module, kinds: dict, folder):
    """Save ``kinds`` ({kind: {name → tensor shaped like the parameter}}) in the module's sharded
    layout, each under the key prefix ``<kind>.``, as one checkpoint (one write, one writer process)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    def now(shard):  # the sharded state holds the parameters themselves: keep the tensors they hold now
        if isinstance(getattr(shard, "data", None), torch.Tensor):
            shard.data = shard.data.detach()
        return shard

    saved = {name: p.data for name, p in module.named_parameters()}
    state = {}
    for kind, tensors in kinds.items():
        for name, p in module.named_parameters():
            p.data = tensors[name]
        state.update(dict_list_map_inplace(now, module.sharded_state_dict(prefix=f"{kind}.")))
    for name, p in module.named_parameters():
        p.data = saved[name]
    Path(folder).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(folder), sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--seed-checkpoint", required=True)
    parser.add_argument("--create-seed", action="store_true")
    parser.add_argument("--passes", default="1,2,3")
    parser.add_argument("--layouts", required=True, help="JSON list of {out, flags, modes (null: all)}, run in turn")
    args = parser.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state

    from fbt_megatron.model import sequence

    torch.set_num_threads(1)
    for layout in json.loads(args.layouts):  # one launch, several layouts: the parallel state is rebuilt for each
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
            sequence._layout.cache_clear()  # layouts are cached per process: they name the old groups
        run_layout(args, Path(layout["out"]), layout["flags"], layout["modes"] or list(RECOMPUTE))
    dist.barrier()
    dist.destroy_process_group()


def run_layout(args, out: Path, overrides: list, modes: list):
    """Every (recompute mode, k) trial at the layout of ``overrides``; results under ``out``."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from fbt_megatron.commands import train
    from fbt_megatron.common import platform
    from fbt_megatron.model.offload import STATS
    from fbt_megatron.trainer import build, checkpointing
    from fbt_megatron.trainer.data import build_data
    from fbt_megatron.trainer.step import data_parallel_mean, run_schedule

    recipe = train.parse_args(["--recipe", "recipes/tiny_cpu.yaml", "--data-path", args.corpus, *SHRINK, *overrides])
    t, p = recipe.training, recipe.parallel
    platform.init_distributed(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, t.seed)
    data = build_data(recipe, dist.get_rank())
    vocab = data.tokenizer.padded_vocab_size(p.tensor_model_parallel_size, recipe.data.make_vocab_size_divisible_by)
    if args.create_seed:
        _, model, _ = build.build_model(recipe, vocab)
        checkpointing.save(args.seed_checkpoint, 0, model, None, None, {"iteration": 0})
        (out / "model.json").parent.mkdir(parents=True, exist_ok=True)
        (out / "model.json").write_text(json.dumps({"vocab_size": vocab, "seq_length": recipe.data.seq_length, **recipe.model_overrides}))

    reporter = dist.get_rank() == dist.get_world_size() - 1  # last stage, last TP and DP rank
    losses, deltas, overlap, offloaded, layer_calls = {}, {}, {}, {}, {}
    base = dict(recipe.model_overrides)
    for mode in modes:
        for k in map(int, args.passes.split(",")):
            recipe.model_overrides = {**base, **RECOMPUTE[mode]}
            config, model, ddp = build.build_model(recipe, vocab)
            checkpointing.load(args.seed_checkpoint, model, None, None)
            optimizer, _ = build.build_optimizer(recipe, config, ddp)
            steps, step_deltas, launches = [], [], record_launches(ddp)
            calls = []
            model.decoder.layers[0].register_forward_hook(lambda *_: calls.append(1))
            STATS.reset()
            for step in range(2):
                launches.clear()  # keep the second step's: the first learns when to launch
                ddp.start_step(k)
                optimizer.zero_grad()
                report = run_schedule(recipe, ddp, data.train, step * t.global_batch_size, k, forward_only=False)
                if report:
                    reduced = data_parallel_mean(report)
                    steps.append(reduced["pass_losses"])
                    step_deltas.append(reduced.get("state_deltas", []))
                if step == 0:
                    grads = {name: g.clone() for name, g in full_gradients(ddp).items()}
                optimizer.step()
            save_tensors(model, {"grads": grads, "params": {n: q.data for n, q in model.named_parameters()}}, out / f"{mode}_k{k}")
            losses[f"{mode}_k{k}"], overlap[f"{mode}_k{k}"] = steps, list(launches)
            deltas[f"{mode}_k{k}"] = step_deltas
            offloaded[f"{mode}_k{k}"] = STATS.bytes
            layer_calls[f"{mode}_k{k}"] = len(calls)
    ranks = [None] * dist.get_world_size()
    stage = dict(pp_rank=parallel_state.get_pipeline_model_parallel_rank(), layers=len(model.decoder.layers),
                 bytes=offloaded, layer_calls=layer_calls)
    dist.all_gather_object(ranks, stage)
    if reporter:
        (out / "losses.json").write_text(json.dumps(losses))
        (out / "deltas.json").write_text(json.dumps(deltas))
        (out / "overlap.json").write_text(json.dumps(overlap))
        (out / "offload.json").write_text(json.dumps(ranks))


if __name__ == "__main__":
    main()
