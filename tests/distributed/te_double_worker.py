"""Worker of the TE double's own test (one process, ``FBT_SIMULATED_DEVICE=1``, ``PYTHONPATH=tests/doubles``):
each of Transformer Engine's per-call rules that the double models, driven through megatron-core's
own TE wrappers, against a computation written here. Prints ``check NAME: ok`` or
``check NAME: FAILED ...``; the test counts them."""

import torch


def build(fusion: bool, transpose_cache_off: bool, **fields):
    """megatron-core's TEColumnParallelLinear (TE's Linear underneath) 16 → 16, with a ``main_grad``."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    from fbt_megatron.common import platform
    from fbt_megatron.model.config import make_config

    config = make_config("tiny", gradient_accumulation_fusion=fusion, latent_feedback=transpose_cache_off,
                         disable_parameter_transpose_cache=transpose_cache_off, **fields)
    torch.manual_seed(0)
    linear = TEColumnParallelLinear(16, 16, config=config, init_method=lambda w: torch.nn.init.normal_(w, std=0.1),
                                    gather_output=False, bias=False, skip_bias_add=False, is_expert=False).to(platform.device())
    linear.weight.main_grad = torch.zeros_like(linear.weight, dtype=torch.float32)
    linear.weight.grad_added_to_main_grad = False
    return linear


def two_calls_backward_in_reverse(linear, x1, x2) -> torch.Tensor:
    """Two forwards of one module (passes 1 and 2), the second's backward first (as pass 2's runs
    before pass 1's): what ``main_grad`` holds after both."""
    y1, _ = linear(x1)
    y2, _ = linear(x2)
    y2.sum().backward()
    y1.sum().backward()
    return linear.weight.main_grad.clone()


def accumulate_rule(device) -> dict:
    x1, x2 = torch.randn(4, 1, 16, device=device), torch.randn(4, 1, 16, device=device)
    expected = (torch.ones(4, 16, device=device).t() @ x1.view(4, 16)) + (torch.ones(4, 16, device=device).t() @ x2.view(4, 16))
    overwritten = two_calls_backward_in_reverse(build(True, transpose_cache_off=False), x1, x2)
    summed = two_calls_backward_in_reverse(build(True, transpose_cache_off=True), x1, x2)
    first_only = torch.ones(4, 16, device=device).t() @ x1.view(4, 16)
    return {
        "is_first_microbatch True: pass 1's backward overwrites main_grad (N1)":
            "ok" if torch.allclose(overwritten, first_only, atol=1e-5) else "FAILED: accumulated",
        "disable_parameter_transpose_cache: every call adds to main_grad":
            "ok" if torch.allclose(summed, expected, atol=1e-5) else "FAILED: not the sum",
    }


def weight_cache(device) -> dict:
    """Under FP8 a False call reuses the weight quantized at the last True call; None quantizes again."""
    from megatron.core.fp8_utils import get_fp8_context

    out = {}
    for off, name in ((False, "is_first_microbatch False reuses the cached FP8 weight"),
                      (True, "None (transpose cache off) quantizes the weight again")):
        linear = build(False, transpose_cache_off=off, fp8="hybrid", fp8_recipe="tensorwise")
        x = torch.randn(4, 1, 16, device=device)
        with torch.no_grad(), get_fp8_context(linear.config):
            linear(x)
            before, _ = linear(x)
            linear.weight.mul_(2.0)
            after, _ = linear(x)
        doubled = torch.allclose(after, 2 * before, rtol=1e-2)
        out[name] = "ok" if doubled == off else f"FAILED: output {'followed' if doubled else 'ignored'} the new weight"
    return out


def delayed_scaling(device) -> dict:
    """Amax as a running maximum until the update; the update only at the outermost exit with grad on."""
    from megatron.core.fp8_utils import get_fp8_context

    linear = build(False, transpose_cache_off=True, fp8="hybrid", fp8_recipe="delayed")
    small, large = torch.full((4, 1, 16), 0.5, device=device), torch.full((4, 1, 16), 2.0, device=device)
    with torch.no_grad(), get_fp8_context(linear.config):
        linear(large)
    state = linear.fp8_meta["scaling_fwd"]
    frozen = torch.equal(state.scale[0].cpu(), torch.tensor(1.0))
    with get_fp8_context(linear.config):
        with get_fp8_context(linear.config):
            linear(large)
        inner_exit = torch.equal(state.scale[0].cpu(), torch.tensor(1.0))
        linear(small)
    updated = torch.allclose(state.scale[0].cpu(), torch.tensor(448 / 2.0))
    return {
        "no scale update at an exit under no_grad (N2)": "ok" if frozen else f"FAILED: scale {state.scale[0].item()}",
        "no scale update at an inner autocast's exit": "ok" if inner_exit else "FAILED: updated",
        "amax a running maximum, scale = 448 / amax at the outer exit":
            "ok" if updated else f"FAILED: scale {state.scale[0].item()}",
    }


def recompute_stash(device) -> dict:
    """TE's checkpoint entered outside the autocast stashes nothing, so the recompute of a delayed-scaling
    module fails (the old ``recompute_passes`` under FP8); entered inside it replays the stashed scale."""
    from megatron.core import tensor_parallel
    from megatron.core.extensions.transformer_engine import te_checkpoint
    from megatron.core.fp8_utils import get_fp8_context

    out = {}
    for inside in (False, True):
        linear = build(False, transpose_cache_off=True, fp8="hybrid", fp8_recipe="delayed")
        x = torch.randn(4, 1, 16, device=device, requires_grad=True)

        def forward(x):
            with get_fp8_context(linear.config):
                return linear(x)[0]

        with get_fp8_context(linear.config):
            forward(x.detach()).sum()  # a first FP8 call: the module knows it runs in FP8
        outer = get_fp8_context(linear.config) if inside else torch.enable_grad()
        try:
            with outer:
                y = te_checkpoint(forward, False, tensor_parallel.get_cuda_rng_tracker, None, x)
            y.sum().backward()
            result = "ok" if inside and x.grad is not None else "FAILED: the recompute ran"
        except KeyError:
            result = "ok" if not inside else "FAILED: no stash inside the autocast"
        name = "checkpoint inside the autocast: the recompute pops its stash" if inside else \
            "checkpoint outside the autocast: nothing stashed, the recompute fails"
        out[name] = result
    return out


def current_scaling(device) -> dict:
    """Tensorwise: input and weight each quantized with 448 / its own amax, the GEMM in FP32."""
    from megatron.core.fp8_utils import get_fp8_context
    from transformer_engine.pytorch.quantization import fake_quantize

    linear = build(False, transpose_cache_off=True, fp8="hybrid", fp8_recipe="tensorwise")
    x = torch.randn(4, 1, 16, device=device)
    with torch.no_grad(), get_fp8_context(linear.config):
        y, _ = linear(x)
    w = linear.weight.detach()
    q = lambda t: fake_quantize(t.float(), 448 / t.abs().max().float(), 448)  # noqa: E731
    expected = q(x.view(4, 16)) @ q(w).t()
    steps = (y.view(4, 16) - x.view(4, 16) @ w.t()).abs().max().item()
    return {"tensorwise: e4m3 input and weight, each with its own scale":
            "ok" if torch.allclose(y.view(4, 16), expected, atol=1e-6) and steps > 1e-4 else "FAILED"}


def refusals(device) -> dict:
    from megatron.core.fp8_utils import get_fp8_context

    out = {}
    linear = build(False, transpose_cache_off=True)
    try:
        linear(torch.randn(4, 1, 16))
        out["a host tensor refused (TE needs CUDA)"] = "FAILED: accepted"
    except RuntimeError as e:
        out["a host tensor refused (TE needs CUDA)"] = "ok" if "needs CUDA" in str(e) else f"FAILED: {e}"
    mx = build(False, transpose_cache_off=True, fp8="hybrid", fp8_recipe="mxfp8")
    try:
        with get_fp8_context(mx.config):
            mx(torch.randn(4, 1, 16, device=device))
        out["MXFP8 refused on an H100"] = "FAILED: accepted"
    except AssertionError as e:
        out["MXFP8 refused on an H100"] = "ok" if "Blackwell" in str(e) else f"FAILED: {e}"
    return out


def main():
    from fbt_megatron.common import platform

    platform.init_distributed()
    device = platform.device()
    checks = {}
    for group in (accumulate_rule, weight_cache, delayed_scaling, recompute_stash, current_scaling, refusals):
        checks.update(group(device))
    for name, verdict in checks.items():
        print(f"check {name}: {verdict}", flush=True)


if __name__ == "__main__":
    main()
