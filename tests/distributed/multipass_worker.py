"""Worker for the multi-process tests, launched by torchrun (dist_checkpointing wants a
__main__-guarded entry point). With --save it builds the test model and saves it with
megatron-core dist_checkpointing first; it then loads that checkpoint into the given parallel
layout, runs the k-pass step for k = 1, 2, 3 and writes what rank 0 saw."""

import argparse
import json

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--batch", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    args = parser.parse_args()

    from megatron.core import dist_checkpointing
    import torch.distributed as dist

    from fbt_megatron import fbt, platform
    from fbt_megatron.config import make_config
    from fbt_megatron.model import FBTModel

    platform.init_distributed(tensor_model_parallel_size=args.tensor_model_parallel_size)
    torch.set_num_threads(1)
    batch = torch.load(args.batch, weights_only=True)
    if args.save:
        from helpers import build

        dist_checkpointing.save(build(seed=3, prefix_mixin_prob=1.0).sharded_state_dict(), args.checkpoint)
    model = FBTModel(make_config("tiny", prefix_mixin_prob=1.0))
    state = dist_checkpointing.load(model.sharded_state_dict(), args.checkpoint)
    model.load_state_dict(state)
    model.train()
    result = {}
    for k in (1, 2, 3):
        model.zero_grad()
        out = fbt.multi_pass_loss(model, batch["tokens"], batch["labels"], batch["loss_mask"], k, batch["seeds"].tolist())
        out.loss.backward()
        result[k] = {
            "pass_losses": [x.item() for x in out.pass_losses],
            "state_deltas": [x.item() for x in out.state_deltas],
            "fusion_grad": [] if k == 1 else model.feedback_fusion.linear_state.weight.grad.flatten()[:64].tolist(),
        }
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
