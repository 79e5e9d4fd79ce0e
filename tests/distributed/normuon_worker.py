"""Worker of the NorMuon TP test: every rank holds its TP shards of the same whole weights (a
column-parallel QKV and MLP matrix, a row-parallel one, one not split by TP) and gradients, and
steps ``NorMuon`` three times in ``duplicated`` mode, where each matrix is orthogonalised by one
owner rank and shared out. Every rank also steps one process's ``NorMuon`` on the whole tensors.
The rank's shards must equal the whole update's chunks bit for bit (weights and ``v``). Prints one
"normuon rank R/N ..." line per rank; exit status 1 when any differs."""

import os
import sys

import torch


def main():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from fbt_megatron.common import platform
    from fbt_megatron.optimizers.normuon import NorMuon

    torch.set_num_threads(1)
    platform.init_distributed(tensor_model_parallel_size=int(os.environ.get("WORLD_SIZE", "1")))
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    shapes = [8, 4, 4]  # Q, K, V rows per query group
    layout = {"qkv": ((2 * 16, 24), 0), "fc1": ((40, 24), 0), "fc2": ((24, 20), 1), "fusion": ((24, 24), None), "odd": ((12, 8), 0)}
    g = torch.Generator().manual_seed(0)
    whole = {name: torch.randn(*shape, generator=g) for name, (shape, _) in layout.items()}
    grads = [{name: torch.randn(*w.shape, generator=g) for name, w in whole.items()} for _ in range(3)]

    def chunk(name, x):
        dim = layout[name][1]
        return x if dim is None else x.chunk(tp, dim=dim)[rank]

    def make(sharded):
        params = {}
        for name, w in whole.items():
            p = torch.nn.Parameter(chunk(name, w).clone() if sharded else w.clone())
            if sharded and layout[name][1] is not None:
                p.tensor_model_parallel, p.partition_dim = True, layout[name][1]
            p.is_qkv = name == "qkv"
            params[name] = p
        tp_group = parallel_state.get_tensor_model_parallel_group() if sharded else None
        return params, NorMuon(list(params.values()), lr=0.02, weight_decay=0.1, qkv_split_shapes=shapes, tp_group=tp_group)

    local, local_opt = make(sharded=True)
    one, one_opt = make(sharded=False)
    for step in grads:
        for name, grad in step.items():
            local[name].grad, one[name].grad = chunk(name, grad).clone(), grad.clone()
        local_opt.step()
        one_opt.step()
    differ = []
    for name, p in local.items():
        dim = layout[name][1]
        v_local, v_one = local_opt.state[p]["second_moment"], one_opt.state[one[name]]["second_moment"]
        if not torch.equal(p.data, chunk(name, one[name].data)):
            differ.append(f"{name} weight")
        if not torch.equal(v_local, v_one.chunk(tp)[rank] if dim == 0 else v_one):
            differ.append(f"{name} v")
    moved = min((p.data - chunk(name, whole[name])).abs().max().item() for name, p in local.items())
    ok = not differ and moved > 0
    print(f"normuon rank {rank}/{tp}: differ {differ or 'none'}, smallest move {moved:.3e} ok {ok}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
