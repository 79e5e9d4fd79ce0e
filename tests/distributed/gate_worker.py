"""Worker of the headwise gate's TP test (2 ranks; argument ``sp`` for sequence parallelism): the
logits and the weight's gradient of ``layers.HeadwiseGate`` equal one process's computation on the
whole sequence and every head, and under SP the gate all-gathers only its logits (heads values per
token), never the normed input. Prints ``check NAME: ok`` / ``check NAME: FAILED ...`` per rank."""

import sys

import torch
import torch.distributed as dist


def main():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    from fbt_megatron.common import platform
    from fbt_megatron.model.config import make_config
    from fbt_megatron.model.layers import HeadwiseGate

    sp = sys.argv[1:] == ["sp"]
    torch.set_num_threads(1)
    platform.init_distributed(tensor_model_parallel_size=2)
    rank, tp_group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
    config = make_config("tiny", tensor_model_parallel_size=2, sequence_parallel=sp)
    s, b, d, heads = 8, 3, config.hidden_size, config.num_attention_heads
    g = torch.Generator().manual_seed(0)
    x, upstream = torch.randn(s, b, d, generator=g), torch.randn(s, b, heads // 2, generator=g)
    weight = torch.randn(heads, d, generator=g)

    gate = HeadwiseGate(config, tp_group)
    gate.weight.data.copy_(weight)
    local = x[rank * s // 2:(rank + 1) * s // 2] if sp else x  # the tokens this rank holds
    gathered = []
    all_gather = mappings.dist_all_gather_func  # what megatron-core's sequence gather calls

    def counting(output, tensor, *args, **kwargs):
        gathered.append(tensor.numel())
        return all_gather(output, tensor, *args, **kwargs)

    mappings.dist_all_gather_func = counting
    try:
        out = gate(local.clone().requires_grad_())
    finally:
        mappings.dist_all_gather_func = all_gather
    out.backward(upstream)
    grad = gate.weight.grad.clone()
    if sp:  # megatron-core's finalize_model_grads: the SP-marked replicated weight summed over TP
        dist.all_reduce(grad, group=tp_group)

    mine = slice(rank * heads // 2, (rank + 1) * heads // 2)
    whole = torch.zeros(s, b, heads)  # one process: all tokens, all heads; each rank's upstream on its heads
    both = [torch.empty_like(upstream) for _ in range(2)]
    dist.all_gather(both, upstream)
    whole[..., :heads // 2], whole[..., heads // 2:] = both
    expected_grad = torch.einsum("sbh,sbd->hd", whole, x)
    checks = {
        "logits of this rank's heads on every token": torch.allclose(out, (x @ weight.t())[..., mine], atol=1e-5),
        "the replicated weight's gradient is the whole one": torch.allclose(grad, expected_grad, atol=1e-4),
        "all-gathers: the logits only under SP, none without": gathered == ([s // 2 * b * heads] if sp else []),
    }
    for name, ok in checks.items():
        print(f"check {name}: {'ok' if ok else f'FAILED (gathered {gathered})'}", flush=True)


if __name__ == "__main__":
    main()
