"""Worker of the sequence-layout test: every rank holds its SP/CP rows of one random [s, b, h]
state; the distributed shift must equal the whole-sequence right shift at those rows, and its
backward must give every row the gradient the whole-sequence computation gives it. Under CP the
ranks' loss shares (their token losses over the loss tokens of whole sequences) must add up to
the whole sequences' masked mean. A second pass (``local`` and ``shift`` again) moves nothing
between the host and the device: the layout's index tensors are on the device once (on a GPU each
such copy from pageable memory is blocking). Each ``--layout TP,CP`` of the world size is checked
in turn (one launch: start-up paid once). Tensors live on ``platform.device()``: under
``FBT_SIMULATED_DEVICE=1`` a device that is not the host, whose TP and CP groups take device tensors
only, as NCCL's do."""

import argparse
import sys
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class HostTransfers(TorchDispatchMode):
    """The ops run under it that move data between the host and the device: those whose tensors
    are on both (a host 0-dim scalar aside), e.g. a copy to the device or indexing with host indices."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [x for x in tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
        if len({x.device.type for x in tensors if x.dim() > 0 or x.device.type != "cpu"}) > 1:
            self.ops.append(str(func))
        return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", action="append", required=True, help="TP,CP (repeatable)")
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state

    from fbt_megatron.model import sequence

    ok = True
    for layout in args.layout:
        tp, cp = map(int, layout.split(","))
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        sequence._layout.cache_clear()  # layouts are cached per process: they name the old groups
        ok = check(SimpleNamespace(tp=tp, cp=cp, seq=args.seq)) and ok
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


def check(args) -> bool:
    """This rank's checks at one (TP, CP) layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from fbt_megatron.common import platform
    from fbt_megatron.distributed.pipeline import _loss_tokens
    from fbt_megatron.model.fbt import masked_mean
    from fbt_megatron.model.sequence import sequence_layout

    platform.init_distributed(args.tp, context_parallel_size=args.cp)
    config = SimpleNamespace(sequence_parallel=args.tp > 1, context_parallel_size=args.cp)
    layout = sequence_layout(config, args.seq)
    g, device = torch.Generator().manual_seed(0), platform.device()
    state, weight = (torch.randn(args.seq, 3, 8, generator=g).to(device) for _ in range(2))

    whole = state.clone().requires_grad_()
    shifted_whole = torch.cat([torch.zeros_like(whole[:1]), whole[:-1]])
    (shifted_whole * weight).sum().backward()

    local = layout.local(state).clone().requires_grad_()
    shifted = layout.shift(local)
    (shifted * layout.local(weight)).sum().backward()

    with HostTransfers() as transfers:  # a second pass
        layout.shift(layout.local(state))
    print(f"rank {dist.get_rank()} tp {args.tp} cp {args.cp}: host-device copies in a second pass: {transfers.ops}", flush=True)

    value_error = (shifted - layout.local(shifted_whole.detach())).abs().max().item()
    grad_error = (local.grad - layout.local(whole.grad)).abs().max().item()
    covered = torch.zeros(args.seq, device=device)
    covered[layout.positions] = 1
    dist.all_reduce(covered)
    ok = value_error == 0 and grad_error == 0 and bool((covered == 1).all()) and not transfers.ops  # every position on one rank

    token_loss, loss_mask = torch.rand(3, args.seq, generator=g).to(device), torch.rand(3, args.seq, generator=g).to(device) > 0.3
    if args.cp > 1:  # [b, s] batches are split along s by CP (not by SP)
        cp_only = sequence_layout(SimpleNamespace(sequence_parallel=False, context_parallel_size=args.cp), args.seq)
        columns = cp_only.positions
        share = masked_mean(token_loss[:, columns], loss_mask[:, columns], _loss_tokens(config, loss_mask[:, columns]))
        dist.all_reduce(share, group=parallel_state.get_context_parallel_group())
        loss_error = (share - masked_mean(token_loss, loss_mask)).abs().item()
        print(f"rank {dist.get_rank()}: CP loss shares add up to the mean within {loss_error:.1e}", flush=True)
        ok = ok and loss_error < 1e-6
    print(f"rank {dist.get_rank()} tp {args.tp} cp {args.cp}: rows {layout.positions.tolist()} value error {value_error} grad error {grad_error}", flush=True)
    return ok


if __name__ == "__main__":
    main()
