"""Worker of the simulated device's own test (2 ranks, ``FBT_SIMULATED_DEVICE=1``): the stand-in refuses
what CUDA + NCCL refuse and computes what gloo computes. Each check prints ``check NAME: ok`` or
``check NAME: FAILED ...``; the test counts them."""

import sys

import torch
import torch.distributed as dist


def refused(action, message: str) -> str:
    """'ok' when ``action()`` raises an error whose text holds ``message``."""
    try:
        action()
    except RuntimeError as e:
        return "ok" if message in str(e) else f"FAILED: another error: {str(e).splitlines()[0]}"
    return "FAILED: accepted"


def main():
    from megatron.core import parallel_state

    from fbt_megatron.common import platform

    platform.init_distributed(2)  # TP 2: megatron-core's groups from the default backend
    rank, device = dist.get_rank(), platform.device()
    checks = {}
    checks["device is not the host"] = "ok" if device.type == "fakegpu" and dist.get_backend() == "fakenccl" else f"FAILED: {device}"

    tp = parallel_state.get_tensor_model_parallel_group()
    host = torch.arange(4.0) + rank
    checks["host tensor on a device group (as NCCL)"] = refused(
        lambda: dist.all_reduce(host.clone(), group=tp), "No backend type associated with device type cpu")
    checks["host tensor in an all-gather (as NCCL)"] = refused(
        lambda: dist.all_gather([torch.empty(4), torch.empty(4)], host, group=tp), "No backend type associated with device type cpu")
    gloo = parallel_state.get_data_parallel_group_gloo()
    checks["device tensor on a gloo group"] = refused(
        lambda: dist.all_reduce(torch.ones(2, device=device), group=gloo), "host (gloo) process group")
    try:
        torch.ones(2, device=device).numpy()
        checks["numpy of a device tensor (as CUDA)"] = "FAILED: accepted"
    except TypeError as e:
        checks["numpy of a device tensor (as CUDA)"] = "ok" if "Use Tensor.cpu()" in str(e) else f"FAILED: {e}"
    checks["host tensor beside a device tensor in a kernel"] = refused(
        lambda: torch.ones(4, device=device) + torch.ones(4), "Expected all tensors to be on the same device")

    # the same numbers as gloo computes on the host tensors
    summed = host.to(device)
    dist.all_reduce(summed, group=tp)
    gathered = torch.empty(8, device=device)
    dist.all_gather_into_tensor(gathered, host.to(device), group=tp)
    scattered = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(scattered, host.to(device), group=tp)
    expected_sum = torch.arange(4.0) * 2 + 1
    results = {
        "all-reduce": (summed, expected_sum),
        "all-gather": (gathered, torch.cat([torch.arange(4.0), torch.arange(4.0) + 1])),
        "reduce-scatter": (scattered, expected_sum[2 * rank:2 * rank + 2]),
    }
    for name, (got, want) in results.items():
        ok = got.device == device and torch.equal(got.cpu(), want)
        checks[f"{name} values, on the device"] = "ok" if ok else f"FAILED: {got.cpu().tolist()} vs {want.tolist()}"
    sent = torch.full((3,), 7.0, device=device) if rank == 0 else torch.empty(3, device=device)
    if rank == 0:
        dist.send(sent, dst=1)
    else:
        dist.recv(sent, src=0)
    checks["send/recv"] = "ok" if sent.cpu().tolist() == [7.0] * 3 else f"FAILED: {sent.cpu().tolist()}"
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank}, group=tp)  # through the device, as on NCCL
    checks["object collective"] = "ok" if objects == [{"rank": 0}, {"rank": 1}] else f"FAILED: {objects}"

    # a scalar on the host is allowed (CUDA takes 0-dim CPU tensors), a .to() keeps megatron's flags
    scaled = torch.ones(2, device=device) * torch.tensor(3.0)
    checks["0-dim host scalar"] = "ok" if scaled.device == device and scaled.cpu().tolist() == [3.0, 3.0] else "FAILED"
    linear = torch.nn.Linear(2, 2)
    linear.weight.sequence_parallel = True
    linear.to(device)
    kept = linear.weight.device == device and getattr(linear.weight, "sequence_parallel", False)
    checks["Module.to keeps a parameter's attributes"] = "ok" if kept else "FAILED"
    # autograd: gradients on the device, equal to the host's
    w = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    on_device = w.to(device).requires_grad_()
    (on_device.sin() * 2).sum().backward()
    on_host = w.clone().requires_grad_()
    (on_host.sin() * 2).sum().backward()
    same = on_device.grad.device == device and torch.equal(on_device.grad.cpu(), on_host.grad)
    checks["autograd"] = "ok" if same else "FAILED"

    for name, verdict in checks.items():
        print(f"rank {rank} check {name}: {verdict}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if all(v == "ok" for v in checks.values()) else 1)


if __name__ == "__main__":
    main()
