"""Worker of the z-loss TP test: every rank holds its vocabulary shard of one random [s, b, V]
logits tensor. The vocab-parallel cross-entropy with z-loss (``fbt_megatron.model.losses``) must give,
on every rank, the per-token cross-entropy and the z term that one process computes on the whole
logits (torch.logsumexp), its backward the whole computation's gradient at this rank's shard,
and with the z-loss off the values and gradients of megatron-core's own vocab-parallel
cross-entropy. Prints one "zloss errors ..." line per rank; exit status 1 when any is too large."""

import os
import sys

import torch


def main():
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from fbt_megatron.common import platform
    from fbt_megatron.model.losses import ZLoss, vocab_parallel_cross_entropy_z

    torch.set_num_threads(1)
    platform.init_distributed(tensor_model_parallel_size=int(os.environ.get("WORLD_SIZE", "1")))
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    s, b, vocab, c = 7, 3, 64, 0.05
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(s, b, vocab, generator=g, dtype=torch.float64).float()
    target = torch.randint(0, vocab, (s, b), generator=g)
    upstream = torch.rand(s, b, generator=g)  # ∂(step loss)/∂(token loss): any weights
    shard = slice(rank * vocab // tp, (rank + 1) * vocab // tp)

    whole = logits.clone().requires_grad_()  # one process, the whole vocabulary
    lse = torch.logsumexp(whole, dim=-1)
    ce = torch.nn.functional.cross_entropy(whole.reshape(-1, vocab), target.reshape(-1), reduction="none").reshape(s, b)
    ((ce + c * lse.square()) * upstream).sum().backward()
    z_whole = (c * lse.detach().square() * upstream).sum()

    def sharded(fn):
        local = logits[..., shard].clone().requires_grad_()
        out = fn(local.clone())  # the losses overwrite their input in place
        out.backward(upstream)
        return out.detach(), local.grad

    z = ZLoss()
    z.start_step(c)
    loss, grad = sharded(lambda x: vocab_parallel_cross_entropy_z(x, target, z))
    off = ZLoss()
    loss_off, grad_off = sharded(lambda x: vocab_parallel_cross_entropy_z(x, target, off))
    loss_mc, grad_mc = sharded(lambda x: tensor_parallel.vocab_parallel_cross_entropy(x, target))

    errors = {
        "loss": (loss - ce.detach()).abs().max().item(),
        "grad": (grad - whole.grad[..., shard]).abs().max().item(),
        "z": abs(z.total.item() - z_whole.item()) / z_whole.item(),
        "off_vs_megatron": max((loss_off - loss_mc).abs().max().item(), (grad_off - grad_mc).abs().max().item()),
    }
    ok = errors["loss"] < 1e-5 and errors["grad"] < 1e-6 and errors["z"] < 1e-6 and errors["off_vs_megatron"] == 0
    ok = ok and off.total.item() == 0 and grad.abs().max().item() > 0
    print(f"zloss errors rank {rank}/{tp}: " + " ".join(f"{k} {v:.2e}" for k, v in errors.items()) + f" ok {ok}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
