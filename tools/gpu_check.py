"""One short check of a GPU machine (run by tools/gpu_check.sh; a few minutes on an H100/H200).

1. the environment (GPUs, torch, megatron-core, Transformer Engine) and the container's imports
   (megatron-core, Transformer Engine's PyTorch modules and this project in one Python);
2. the Transformer Engine spec against the local spec with the same weights: per-pass losses and
   gradients of the k-pass step, k = 1, 2, 3, in FP32 (TF32 off); then BF16 and FP8 (delayed scaling),
   and FP8 k = 3 with pass recompute on against off (the recompute must quantize as the forward did);
   then the attention kernels that train the model — TE in BF16 (flash / fused attention) against the
   local spec in BF16 at fbt-1b's head geometry (16 query / 8 KV heads of 96, window 2048 in 5 of 6
   layers), with a control without the window that must differ. Without Transformer Engine: the local
   spec in BF16 against FP32, the TE, FP8 and kernel checks skipped (one line each), and everything
   below on the local spec;
3. fbt-1b throughput, MFU and peak memory in BF16 for k = 1, 2, 3 and k = 3 with recompute_passes (and
   the planner's memory estimate, fbt_megatron/plan, against the measured peak at k = 3);
   then at long context (32K), k = 3, the recompute inputs kept on the GPU against offloaded to host
   memory by offload_recompute_inputs and by DeepSpeed's cpu_checkpointing (when installed): peak
   memory, step time, and the same gradients;
4. with 2+ GPUs, through the training entry point (NCCL) against 1 GPU: TP=2 with sequence
   parallelism (Adam, and NorMuon: its owner gather and scatter), FP32; CP=2 in BF16 (TE attention,
   its communication type);
5. with ``--slurm-nodes 2`` (from a login node): a 2-node job through slurm/train.sbatch at TP 2 + SP,
   the time-limit signal mid-run: the training checkpoints and exits 0, the job requeues itself,
   the next attempt resumes there and finishes; NCCL's transport between the nodes from its log;
6. a summary table. Exit code: 0 all that ran passed, 1 a check failed, 2 megatron-core missing; a
   run with skipped checks says what was not checked in its last line.
Without a GPU (this CPU machine) the BF16-against-FP32 check runs on the CPU and the GPU sections
say they are skipped and why.

    tools/gpu_check.sh [--skip-perf] [--skip-multi-gpu] [--perf-seq-length 4096] [--offload-seq-length 32768]
"""

from __future__ import annotations

import os

# Transformer Engine runs FP32 GEMMs in TF32 whatever torch's flags say; this environment variable makes
# cuBLAS use full FP32 (BF16/FP8 GEMMs are unaffected). Read when CUDA starts: set before importing torch.
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
# One hardware queue per GPU, as the job script sets it for TP > 1 or CP > 1 (the paper's recipes, the
# long-context one): the speed and offloading rows are timed as those jobs run (fbt_megatron/launch/slurm/script.py).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import argparse
import contextlib
import gc
import importlib
import math
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KS = (1, 2, 3)
# equivalence model: small, FP8-friendly (every TE GEMM dimension a multiple of 16), sliding window used
SMALL = dict(num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4, num_query_groups=2,
             kv_channels=64, vocab_size=4096, seq_length=256, sliding_window=64, full_attention_every=2)
BF16 = dict(bf16=True, params_dtype=torch.bfloat16)
FP8 = dict(BF16, fp8="hybrid", fp8_recipe="delayed")
# A random-init model's loss is close to log V whatever the network computes (on CPU a wrong attention
# window moves it by ~1e-4 relative at k=1, BF16 rounding by ~1e-4): the FP32 gradients are the sensitive
# check (a wrong window or norm gives ~0.4-1.5 there); the loss bounds below catch gross errors only.
TOL = {
    "fp32 loss": 1e-5,  # relative, TE vs local, both FP32 with TF32 off: summation order only
    "fp32 grad": 1e-3,  # max |g_te - g_local| / max |g_local|, worst parameter tensor
    "bf16 loss": 2e-3,  # relative, BF16 TE vs FP32 local
    "fp8 loss": 1e-2,  # relative, FP8 TE vs BF16 TE
    "fp8 recompute grad": 1e-3,  # max-norm relative, FP8 k=3 gradients with pass recompute on vs off (same FP8 scales)
    "kernel grad": 3e-2,  # max-norm relative, TE BF16 (flash/fused attention) vs local BF16 at fbt-1b's heads and window
    "tp loss": 1e-4,  # relative, TP=2 (+SP) vs 1 GPU, every logged per-pass loss over 12 FP32 training steps (CPU/gloo TP: 1e-7)
    "cp loss": 1e-2,  # relative, CP=2 vs 1 GPU, both BF16 (TE has no FP32 attention under CP)
}
# fbt-1b's attention: heads, KV groups, head dim, window and global layers; 6 layers (5 windowed, 1 global)
GEOMETRY = dict(num_layers=6, hidden_size=1536, ffn_hidden_size=6656, num_attention_heads=16, num_query_groups=8,
                kv_channels=96, vocab_size=4096, seq_length=4096, sliding_window=2048, full_attention_every=6)
TP_STEPS = 12

rows = []  # (check, value, tolerance / goal, PASS | FAIL | INFO | SKIP)
TE = False  # Transformer Engine usable (set by environment())


def record(check, value, goal="info", ok=None):
    rows.append((check, value, goal, "INFO" if ok is None else ok if isinstance(ok, str) else "PASS" if ok else "FAIL"))


def skip(check, why):
    """One line now and one SKIP row in the summary."""
    print(f"{check}: skipped: {why}")
    record(check, f"skipped: {why}", "-", "SKIP")


NO_GPU = "no CUDA GPU on this machine"
NO_TE = "needs Transformer Engine (not installed)"


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


# ---------------------------------------------------------------- 1. environment
def transformer_engine_version():
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401  (a broken build fails here)
    except Exception as e:  # ImportError, or a build that does not match this torch/CUDA
        return None, e
    return getattr(transformer_engine, "__version__", "unknown"), None


def environment() -> int:
    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    if not torch.cuda.is_available():
        print("no GPU: CUDA is not available to this Python (on a GPU node: run in the project image, docs/gpu.md#the-container, or a venv "
              "with CUDA torch); the checks that need one are skipped below, the rest run on the CPU")
    else:
        print(f"{torch.cuda.device_count()} GPU(s)")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"GPU {i}: {p.name}, sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB")
        print(f"cuDNN {torch.backends.cudnn.version()}, NCCL {torch.cuda.nccl.version()}")
    try:
        import megatron.core
    except ImportError as e:
        print(f"error: megatron-core is not importable ({e}); pip install megatron-core==0.16.1")
        return 2
    print(f"megatron-core {megatron.core.__version__}")
    global TE
    te_version, error = transformer_engine_version()
    TE = te_version is not None
    if not TE:
        how = "the project's image ships it: packaging/container/Dockerfile, docs/gpu.md#the-container"
        print(f"no Transformer Engine ({type(error).__name__}: {error}): the local spec runs every check; "
              f"the TE and FP8 checks are skipped ({how})")
    else:
        print(f"transformer-engine {te_version}")
    print(f"NVIDIA_TF32_OVERRIDE={os.environ['NVIDIA_TF32_OVERRIDE']} (0: cuBLAS never uses TF32 for FP32 GEMMs)")
    container_imports(te_version, error)
    return 0


def container_imports(te_version, error):
    """The training image's software in this one Python: a CUDA torch, megatron-core, TE's PyTorch
    modules and this project (what a --container-image job needs; docs/gpu.md)."""
    check = "container: CUDA torch, megatron-core, Transformer Engine, fbt_megatron import"
    if DEVICE != "cuda":
        skip(check, NO_GPU + " (run this inside the training image on a GPU node)")
        return
    import megatron.core

    import fbt_megatron  # noqa: F401

    found = f"torch {torch.__version__}, megatron-core {megatron.core.__version__}, TE {te_version or error}"
    record(check, found[:100], "all import", te_version is not None)


# ---------------------------------------------------------------- shared helpers
def build(te: bool, preset="tiny", **fields):
    """FBTModel on the GPU (else the CPU) as fbt_megatron.train builds it (config dtype, model .to(dtype)), in train mode."""
    from fbt_megatron.model.config import make_config
    from fbt_megatron.model.fbt_model import FBTModel, fbt_model_spec

    config = make_config(preset, **fields)
    model = FBTModel(config, spec=fbt_model_spec(config, use_transformer_engine=te))
    return model.to(config.params_dtype).to(DEVICE).train()  # plain torch modules (fusion, norms) start on CPU


def make_batch(vocab, seq, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(DEVICE)
    mask = torch.ones(batch, seq, device=DEVICE)
    mask[0, : seq // 8] = 0
    return dict(tokens=x[:, :-1].contiguous(), labels=x[:, 1:].contiguous(), loss_mask=mask,
                seeds=list(range(100, 100 + batch)))


def train_step(model, batch, k):
    """Forward + backward of the k-pass step (fbt.multi_pass_loss), gradients left in .grad."""
    from fbt_megatron.model.fbt import multi_pass_loss

    model.zero_grad(set_to_none=True)
    model.set_is_first_microbatch()  # FP8: re-quantize weights once per step, as megatron's schedules do
    out = multi_pass_loss(model, batch["tokens"], batch["labels"], batch["loss_mask"], k, batch["seeds"])
    out.loss.backward()
    return out


def losses_and_grads(model, batch, k):
    out = train_step(model, batch, k)
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None and p.numel()}
    return [x.item() for x in out.pass_losses], grads


def copy_weights(weights: dict, model) -> int:
    """Load the local spec's weights into ``model``; names must match except TE's _extra_state (FP8
    metadata) and the MLP's input norm, a parameter of TE's fused norm + linear (``model.FUSED_NORM_KEYS``,
    the names checkpoints give it). Returns the number of parameter tensors, every one checked to be
    equal to its source."""
    from fbt_megatron.model.fbt_model import FUSED_NORM_KEYS

    if any(n.endswith("mlp.linear_fc1.layer_norm_weight") for n, _ in model.named_parameters()):
        for te_name, local_name in FUSED_NORM_KEYS.items():
            weights = {k.replace(local_name, te_name): v for k, v in weights.items()}
    empty = {n for n, p in model.named_parameters() if not p.numel()}  # bias=False in some TE versions
    missing, unexpected = model.load_state_dict(weights, strict=False)
    bad = sorted(unexpected) + [k for k in missing if not k.endswith("_extra_state") and k not in empty]
    if bad:
        raise AssertionError(f"parameter names differ between the local and TE specs: {bad[:6]}")
    params = {n: p for n, p in model.named_parameters() if n not in empty}
    not_copied = [n for n, p in params.items() if n not in weights or not torch.equal(p.detach(), weights[n].to(p.dtype))]
    if not_copied:
        raise AssertionError(f"parameters not copied: {not_copied[:6]}")
    return len(params)


def grad_diff(grads, ref):
    """Worst parameter tensor: max |g - g_ref| / max |g_ref| (inf where one side has no gradient)."""
    worst, name = 0.0, "-"
    for n in set(ref) | set(grads):
        if n not in ref or n not in grads:
            return math.inf, f"{n} (gradient on one side only)"
        scale, d = ref[n].abs().max().item(), (grads[n] - ref[n]).abs().max().item()
        r = d / scale if scale > 0 else (0.0 if d == 0 else math.inf)
        if r > worst:
            worst, name = r, n
    return worst, name


def fmt(losses):
    return "/".join(f"{x:.6f}" for x in losses)


def free():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- 2. TE vs local, FP32 / BF16 / FP8
def compare(label, model, batch, reference, against, spec="TE"):
    """The k-pass losses and gradients of ``model`` for k = 1..3 against ``reference`` (k → (losses,
    grads)); prints each k and returns (results, worst loss difference, worst gradient difference)."""
    results, worst_loss, worst_grad = {}, 0.0, 0.0
    for k in KS:
        results[k] = losses, grads = losses_and_grads(model, batch, k)
        ld = max(rel(a, b) for a, b in zip(losses, reference[k][0]))
        gd, name = grad_diff(grads, reference[k][1])
        worst_loss, worst_grad = max(worst_loss, ld), max(worst_grad, gd)
        print(f"{label:4s} k={k}: {spec} {fmt(losses)} | {against} {fmt(reference[k][0])} | loss rel {ld:.1e} | grad rel {gd:.1e} ({name})")
    return results, worst_loss, worst_grad


def equivalence():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    batch = make_batch(SMALL["vocab_size"], SMALL["seq_length"], batch=4)
    torch.manual_seed(0)
    local = build(False, **SMALL)  # the reference: FP32, megatron-core local modules
    with torch.no_grad():  # non-trivial norm weights: a norm that is not copied or not applied shows
        for n, p in local.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    weights = {k: v for k, v in local.state_dict().items() if not k.endswith("_extra_state")}
    ref = {k: losses_and_grads(local, batch, k) for k in KS}
    del local

    spec = "TE" if TE else "local"
    print(f"\n== {'TE spec vs local spec' if TE else 'local spec, BF16 vs FP32'}, {SMALL['num_layers']} layers, "
          f"D={SMALL['hidden_size']}, {batch['tokens'].shape[0]}x{SMALL['seq_length']} tokens, {DEVICE}")
    if TE:
        te = build(True, **SMALL)
        record("FP32: weights local -> TE spec", f"{copy_weights(weights, te)} tensors equal", "all parameters", True)
        _, worst_loss, worst_grad = compare("fp32", te, batch, ref, "local")
        record("FP32 TE vs local: per-pass loss, k=1..3", f"{worst_loss:.1e}", f"< {TOL['fp32 loss']:.0e} rel", worst_loss < TOL["fp32 loss"])
        record("FP32 TE vs local: gradients, k=1..3", f"{worst_grad:.1e}", f"< {TOL['fp32 grad']:.0e} rel (max-norm)", worst_grad < TOL["fp32 grad"])
        del te
        free()
    else:
        skip("FP32 TE vs local: per-pass loss and gradients, k=1..3", NO_TE)

    half = build(TE, **SMALL, **BF16)
    copy_weights(weights, half)
    bf16, worst_loss, worst_grad = compare("bf16", half, batch, ref, "fp32 local", spec)
    record(f"BF16 {spec} vs FP32 local: per-pass loss, k=1..3", f"{worst_loss:.1e}", f"< {TOL['bf16 loss']:.0e} rel", worst_loss < TOL["bf16 loss"])
    record(f"BF16 {spec} vs FP32 local: gradients, k=1..3", f"{worst_grad:.1e}")
    del half
    free()

    if not TE:
        skip("FP8 TE vs BF16 TE", NO_TE)
        return
    if torch.cuda.get_device_capability() < (8, 9):
        record("FP8 TE vs BF16 TE", "skipped: FP8 needs sm89+ (Ada, Hopper, Blackwell)", "-", "SKIP")
        return
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    te8 = build(True, **SMALL, **FP8)
    copy_weights(weights, te8)
    in_fp8 = []  # megatron-core's TransformerBlock enters TE's fp8_autocast (get_fp8_context) when config.fp8 is set
    hook = te8.decoder.layers[0].self_attention.linear_qkv.register_forward_pre_hook(
        lambda *_: in_fp8.append(FP8GlobalStateManager.is_fp8_enabled())
    )
    for _ in range(2):  # calibrate the delayed-scaling amax history (weights do not change)
        train_step(te8, batch, 3)
    _, worst_loss, worst_grad = compare("fp8", te8, batch, bf16, "bf16 TE")
    hook.remove()
    record("FP8: TE linears run inside fp8_autocast", str(bool(in_fp8) and all(in_fp8)), "True", bool(in_fp8) and all(in_fp8))
    record("FP8 TE vs BF16 TE: per-pass loss, k=1..3", f"{worst_loss:.1e}", f"< {TOL['fp8 loss']:.0e} rel", worst_loss < TOL["fp8 loss"])
    record("FP8 TE vs BF16 TE: gradients, k=1..3", f"{worst_grad:.1e}")
    fp8_recompute(te8, batch)
    del te8
    free()


def fp8_recompute(model, batch):
    """FP8 k = 3 gradients with ``recompute_passes`` on against off, from the same FP8 scales (TE's
    extra state restored in between): a recompute outside TE's checkpoint quantizes the recomputed
    forward with other scales and updates the amax history twice (fbt_megatron.model.offload.checkpoint)."""
    import copy

    scales = copy.deepcopy({k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")})
    model.config.recompute_passes = False
    _, kept = losses_and_grads(model, batch, 3)
    model.load_state_dict(scales, strict=False)
    model.config.recompute_passes = True
    try:
        _, recomputed = losses_and_grads(model, batch, 3)
    finally:
        model.config.recompute_passes = False
    d, where = grad_diff(recomputed, kept)
    record("FP8 k=3: gradients with recompute_passes vs without", f"{d:.1e} ({where})"[:60],
           f"< {TOL['fp8 recompute grad']:.0e} rel (max-norm)", d < TOL["fp8 recompute grad"])


def attention_backend() -> str:
    """The backend Transformer Engine's DotProductAttention last ran (its module's record), or why unknown."""
    try:
        from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa
    except ImportError as e:
        return f"unknown ({e})"
    chosen = getattr(dpa, "_attention_backends", {})
    names = [n for n, key in (("FlashAttention", "use_flash_attention"), ("FusedAttention", "use_fused_attention"),
                              ("UnfusedDotProductAttention", "use_unfused_attention")) if chosen.get(key)]
    return names[0] if names else "unknown (this TE does not record it; see NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2)"


def attention_kernels(seq):
    """The attention that trains the model: TE in BF16 (FlashAttention or FusedAttention, never the
    unfused path the FP32 check runs) against the local spec in BF16 on the same weights, k = 2, at
    fbt-1b's head geometry and window (``GEOMETRY``). The control, TE without the window against the
    same local run, must differ by more than 10x the tolerance: the comparison can see a wrong window."""
    from fbt_megatron.common import platform

    fields = dict(GEOMETRY, seq_length=seq)
    print(f"\n== attention kernels: TE BF16 vs local BF16, {fields['num_attention_heads']}/{fields['num_query_groups']} heads "
          f"of {fields['kv_channels']}, window {fields['sliding_window']} (global every {fields['full_attention_every']}), seq {seq}")
    batch = make_batch(fields["vocab_size"], seq, 1)
    platform.seed(1234)
    local = build(False, **fields, **BF16)
    weights = {k: v for k, v in local.state_dict().items() if not k.endswith("_extra_state")}
    reference = losses_and_grads(local, batch, 2)[1]
    del local
    free()
    verdicts = {}
    for label, window in (("TE", fields["sliding_window"]), ("TE without the window", None)):
        te = build(True, **dict(fields, sliding_window=window), **BF16)
        copy_weights(weights, te)
        losses, grads = losses_and_grads(te, batch, 2)
        verdicts[label] = (*grad_diff(grads, reference), attention_backend())
        print(f"{label}: {fmt(losses)}; gradients vs local: {verdicts[label][0]:.1e} ({verdicts[label][1]}); {verdicts[label][2]}")
        del te, grads
        free()
    d, where, backend = verdicts["TE"]
    fused = backend in ("FlashAttention", "FusedAttention")
    record("attention kernels: TE BF16 vs local BF16 (fbt-1b heads, window)", f"{d:.1e} ({where}); {backend}"[:80],
           f"< {TOL['kernel grad']:.0e} rel, flash/fused", d < TOL["kernel grad"] and fused)
    control = verdicts["TE without the window"][0]
    record("attention kernels control: TE without the window vs local", f"{control:.1e}",
           f"> {10 * TOL['kernel grad']:.0e} (sees the window)", control > 10 * TOL["kernel grad"])


# ---------------------------------------------------------------- 3. fbt-1b performance
def peak_flops():
    """Dense BF16 peak FLOP/s of this GPU (the planner's table, fbt_megatron/common/gpus.py); FBT_PEAK_FLOPS overrides."""
    from fbt_megatron.common.gpus import from_device_name

    if os.environ.get("FBT_PEAK_FLOPS"):
        return float(os.environ["FBT_PEAK_FLOPS"]), "FBT_PEAK_FLOPS"
    name = torch.cuda.get_device_name()
    gpu = from_device_name(name)
    return (gpu.bf16_tflops * 1e12, gpu.name) if gpu else (None, name)


def planned_memory(model, micro_batch, seq, k) -> float:
    """The planner's peak-memory estimate (fbt_megatron/launch/plan/memory.py) for this bare-model step, GiB:
    BF16 weights and their BF16 .grad (no DDP buffer, no optimizer here) plus the activations."""
    from fbt_megatron.launch.plan import memory

    params = sum(p.numel() for p in model.parameters())
    layout = memory.Layout(micro_batch_size=micro_batch, seq_length=seq, half=True, transformer_engine=TE)
    stage = memory.Stage(rank=0, layers=model.config.num_layers, params=params, matrix_params=0, matrix_rows=0, first=True, last=True)
    return (4 * params + memory.activations(model.config, layout, stage, k).total) / 2**30


def performance(seq, micro_batch, steps):
    peak, peak_from = peak_flops()
    print(f"\n== fbt-1b, BF16, {'Transformer Engine' if TE else 'local spec'}, micro batch {micro_batch} x seq {seq}; "
          f"peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s ({peak_from})")
    model = build(TE, "fbt-1b", seq_length=seq, **BF16)
    batch = make_batch(model.config.vocab_size, seq, micro_batch)
    tokens = micro_batch * seq
    from fbt_megatron.model.flops import flops_per_token

    c = model.config
    print("MFU = model FLOPs / step time / peak; model FLOPs per token of a k-pass step (fbt_megatron/model/flops.py): "
          "3*[k*(2*N + 2*V*D + 4*h*d_h*sum_l c_l) + (k-1)*4*D^2], forward+backward, no optimizer step")
    for label, k, recompute in [("k=1", 1, False), ("k=2", 2, False), ("k=3", 3, False), ("k=3 recompute_passes", 3, True)]:
        c.recompute_passes = recompute
        model.zero_grad(set_to_none=True)
        free()
        torch.cuda.reset_peak_memory_stats()
        try:
            for _ in range(2):  # warm-up
                train_step(model, batch, k)
            torch.cuda.synchronize()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                train_step(model, batch, k)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        except torch.cuda.OutOfMemoryError:
            print(f"{label}: out of memory")
            record(f"fbt-1b BF16 {label}", "OOM")
            continue
        t = statistics.median(times)
        mfu = tokens * flops_per_token(c, k) / t / peak if peak else None
        mem = torch.cuda.max_memory_allocated() / 2**30
        if label == "k=3":  # the one planner row: its estimate against the allocator's peak
            planned = planned_memory(model, micro_batch, seq, k)
            record("planner memory estimate, fbt-1b BF16 k=3", f"{planned:.1f} vs {mem:.1f} GiB measured ({planned / mem:.2f}x)",
                   "within 20%", abs(planned / mem - 1) <= 0.2)
        mfu_text = f"MFU {mfu:.1%}" if mfu is not None else "MFU n/a (set FBT_PEAK_FLOPS)"
        print(f"{label}: {t * 1e3:.0f} ms/step (median of {steps}), {tokens / t:,.0f} tokens/s, {mfu_text}, peak memory {mem:.1f} GiB")
        record(f"fbt-1b BF16 {label}", f"{tokens / t:,.0f} tok/s, {mfu_text}, {mem:.1f} GiB")
    c.recompute_passes = False
    del model, batch
    free()


FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
OFFLOAD_SETUPS = {  # the long-context k = 3 budget: what recompute keeps, on the GPU or in host memory
    "recompute_passes + full": dict(recompute_passes=True, **FULL_RECOMPUTE),
    "full": FULL_RECOMPUTE,
}


@contextlib.contextmanager
def deepspeed_checkpointing():
    """Recompute through DeepSpeed's checkpoint with ``cpu_checkpointing`` (the design card's candidate)
    instead of megatron-core's. DeepSpeed empties every checkpoint input in place once copied to the host,
    which breaks inputs shared between checkpoints (megatron-core hands one RoPE table to every layer), so
    each input is cloned first."""
    import deepspeed
    from megatron.core import parallel_state, tensor_parallel

    deepspeed.init_distributed(dist_backend="nccl")  # adopts the process group already initialised
    deepspeed.checkpointing.configure(parallel_state, partition_activations=False, checkpoint_in_cpu=True)
    megatron_checkpoint = tensor_parallel.checkpoint

    def checkpoint(function, distribute_saved_activations, *args):
        args = [a.clone() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        return deepspeed.checkpointing.checkpoint(function, *args)

    tensor_parallel.checkpoint = checkpoint  # looked up at call time by megatron-core's block and fbt.run_pass
    try:
        yield
    finally:
        tensor_parallel.checkpoint = megatron_checkpoint


def deepspeed_missing():
    try:
        importlib.import_module("deepspeed")  # a broken install fails here
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def offloading(seq, steps):
    """fbt-1b, BF16 TE, k = 3 at sequence ``seq``: each recompute setup with its inputs kept on the GPU,
    offloaded by ``offload_recompute_inputs`` and (if installed) by DeepSpeed's cpu_checkpointing; peak
    memory, step time, and the first step's gradients against the kept run's (recompute order only)."""
    from fbt_megatron.common import platform

    print(f"\n== fbt-1b, BF16, Transformer Engine, k=3, micro batch 1 x seq {seq}: recompute inputs kept vs offloaded")
    # name: (model fields, context, gated: its rows are PASS/FAIL checks; the DeepSpeed comparison informs)
    candidates = {"kept": ({}, contextlib.nullcontext, True),
                  "offload_recompute_inputs": (dict(offload_recompute_inputs=True), contextlib.nullcontext, True)}
    missing = deepspeed_missing()
    if missing:
        print(f"DeepSpeed cpu_checkpointing: skipped ({missing})")
        record("offload: DeepSpeed cpu_checkpointing", f"skipped: {missing}"[:100], "-", "SKIP")
    else:
        candidates["DeepSpeed cpu_checkpointing"] = ({}, deepspeed_checkpointing, False)
    for name, setup in OFFLOAD_SETUPS.items():
        reference = None
        for candidate, (fields, context, gated) in candidates.items():
            free()
            label = f"k=3 seq {seq} {name}, {candidate}"
            platform.seed(1234)  # the same weights for every candidate
            model = build(True, "fbt-1b", seq_length=seq, **fields, **setup, **BF16)
            batch = make_batch(model.config.vocab_size, seq, 1)
            torch.cuda.reset_peak_memory_stats()
            try:
                with context():
                    train_step(model, batch, 3)  # also the warm-up
                    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(steps):
                        train_step(model, batch, 3)
                    torch.cuda.synchronize()
            except torch.cuda.OutOfMemoryError:
                print(f"{label}: out of memory")
                record(f"fbt-1b {label}", "OOM")
                model = batch = None
                if reference is None:
                    break  # nothing to compare against
                continue
            except Exception as e:  # a candidate that breaks fails its check; the others still run
                traceback.print_exc()
                record(f"offload, {name}, {candidate}", f"{type(e).__name__}: {' '.join(str(e).split())}"[:60], "runs",
                       False if gated else None)
                model = batch = None
                if reference is None:
                    break
                continue
            t = (time.perf_counter() - start) / steps
            mem = torch.cuda.max_memory_allocated() / 2**30
            print(f"{label}: {t * 1e3:.0f} ms/step (mean of {steps}), {seq / t:,.0f} tokens/s, peak memory {mem:.1f} GiB")
            if reference is None:
                reference, (t0, m0) = grads, (t, mem)
            else:
                diff, where = grad_diff(grads, reference)
                record(f"offload, {name}, {candidate}: gradients vs kept", f"{diff:.1e} ({where})"[:60], "< 2e-2 rel",
                       diff < 2e-2 if gated else None)
                record(f"offload, {name}, {candidate}: peak memory / kept", f"{mem:.1f} / {m0:.1f} GiB = {mem / m0:.2f}", "< 1",
                       mem < m0 if gated else None)
                record(f"offload, {name}, {candidate}: step time / kept", f"{t / t0:.3f}")
            model = batch = grads = None
    free()


# ---------------------------------------------------------------- 4. multi-GPU
def launch(cmd, log: Path, timeout: int, **extra_env):
    print("$ " + " ".join(shlex.quote(str(x)) for x in cmd), flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
               **extra_env)
    with open(log, "w") as f:
        code = subprocess.run([str(x) for x in cmd], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if code:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(f"exit code {code}; end of {log}:\n{tail}")


SP = ["--tensor-model-parallel-size", 2, "--sequence-parallel", "true"]
# name: (flags, the 1-GPU reference's flags, tolerance): the paper's layout (TP 2 + SP) with Adam and with
# NorMuon (its owner gathers and scatters), FP32; CP 2 in BF16 (TE's attention under CP has no FP32)
MULTI_GPU = {
    "TP=2+SP": (SP, [], "tp loss"),
    "TP=2+SP NorMuon": ([*SP, "--optimizer", "normuon"], ["--optimizer", "normuon"], "tp loss"),
    "CP=2 BF16": (["--context-parallel-size", 2, "--bf16", "true"], ["--bf16", "true"], "cp loss"),
}


def multi_gpu(parent: Path):
    if torch.cuda.device_count() < 2:
        for name in MULTI_GPU:
            skip(f"{name} vs 1 GPU (entry point, NCCL)", "needs 2 GPUs" if DEVICE == "cuda" else NO_GPU)
        return
    print(f"\n== {', '.join(MULTI_GPU)} vs 1 GPU through fbt_megatron.train (recipes/tiny_cpu.yaml, {TP_STEPS} steps, same seed checkpoint)")
    parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=parent))
    print(f"run folders and logs: {workdir}")
    seed = workdir / "seed"
    recipe = ["--recipe", "recipes/tiny_cpu.yaml", "--tensorboard", "false"]
    train = [*recipe, "--load", seed, "--train-iters", TP_STEPS, "--lr-warmup-iters", 2, "--log-interval", 1,
             "--eval-iters", 0, "--pass-phases", "[{start: 0.0, mixture: {1: 0.4, 2: 0.3, 3: 0.3}}]",
             "--override-opt-param-scheduler"]
    entry = [sys.executable, "-m", "fbt_megatron.train"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", 2, "-m", "fbt_megatron.train"]
    launch([*entry, *recipe, "--save", seed, "--create-seed-checkpoint", "true"], workdir / "seed.log", 900)  # prepares the corpus on first use

    from fbt_megatron.trainer.metrics import read_metrics

    references = {}
    for name, (flags, reference_flags, tolerance) in MULTI_GPU.items():
        check = f"{name} vs 1 GPU: per-pass losses, {TP_STEPS} steps"
        if name.startswith("CP") and not TE:
            skip(f"{name} vs 1 GPU (entry point, NCCL)", "context parallelism " + NO_TE)
            continue
        key = " ".join(map(str, reference_flags))
        folder = workdir / name.replace("=", "").replace("+", "_").replace(" ", "_")
        try:
            if key not in references:
                one = workdir / f"gpu1_{len(references)}"
                launch([*entry, *train, *reference_flags, "--save", one], one.with_suffix(".log"), 600)
                references[key] = {r["step"]: r for r in read_metrics(one)}
            launch([*torchrun, *train, *flags, "--save", folder], folder.with_suffix(".log"), 600,
                   NVTE_DEBUG="1", NVTE_DEBUG_LEVEL="2")  # TE names the attention backend it runs
        except RuntimeError as e:
            print(e)
            record(check, "run failed (see log)", f"< {TOL[tolerance]:.0e} rel", False)
            continue
        a, b = references[key], {r["step"]: r for r in read_metrics(folder)}
        if sorted(a) != sorted(b) or any(a[s]["k"] != b[s]["k"] for s in a):
            record(check, "logged steps or k differ", f"< {TOL[tolerance]:.0e} rel", False)
            continue
        worst = 0.0
        for step in sorted(a):
            diffs = [rel(x, y) for x, y in zip(b[step]["pass_losses"], a[step]["pass_losses"])]
            worst = max([worst, *diffs])
            print(f"step {step:>3} k={a[step]['k']}: 1 GPU {fmt(a[step]['pass_losses'])} | {name} {fmt(b[step]['pass_losses'])} | rel {max(diffs):.1e}")
        record(check, f"{worst:.1e}", f"< {TOL[tolerance]:.0e} rel", worst < TOL[tolerance])
        if name.startswith("CP"):  # the type chosen for windowed layers (banner) and a flash/fused backend (TE's log)
            log = folder.with_suffix(".log").read_text()
            comm = "over a2a" in log or "over all_gather" in log
            fused = "Running with FusedAttention" in log or "Running with FlashAttention" in log
            record(f"{name}: TE attention backend and CP communication type", f"fused/flash {fused}, a2a/all_gather {comm}",
                   "both in the log", fused and comm)


# ---------------------------------------------------------------- 5. a job through the real script
def wait_for(condition, what: str, timeout: float):
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            raise RuntimeError(f"{what} within {timeout:.0f} s")
        time.sleep(2)


def slurm_job(parent: Path, nodes: int, submit_args: list):
    """``recipes/tiny_cpu.yaml`` at TP 2 + SP on ``nodes`` nodes through ``python -m fbt_megatron.slurm
    submit`` and slurm/train.sbatch (the image check, torchrun, NCCL with NCCL_DEBUG=INFO); mid-run the
    time-limit signal (USR1 to the batch shell, as ``--signal=B:USR1@S`` sends it): the training must
    checkpoint and exit 0, the job requeue itself and the next attempt resume there and finish."""
    import json
    import re

    from fbt_megatron.trainer.metrics import read_metrics

    workdir = Path(tempfile.mkdtemp(prefix="gpu_check-slurm-", dir=parent))
    steps, runs, logs = 60, workdir / "runs", workdir / "logs"
    command = [sys.executable, "-m", "fbt_megatron.slurm", "submit", "--recipe", "recipes/tiny_cpu.yaml", "--nodes", nodes,
               "--gpus-per-node", torch.cuda.device_count(), "--time", "00:30:00", "--runs-root", runs, "--log-dir", logs,
               "--env", "NCCL_DEBUG=INFO", *submit_args, "--", "--train-iters", steps, "--save-interval", 20,
               "--log-interval", 1, "--eval-iters", 0, "--tensorboard", "false", *SP]
    print(f"\n== a {nodes}-node job through slurm/train.sbatch, the time-limit signal mid-run; in {workdir}")
    print("$ " + " ".join(shlex.quote(str(x)) for x in command), flush=True)
    submitted = subprocess.run([str(x) for x in command], cwd=REPO, capture_output=True, text=True, timeout=300)
    print(submitted.stdout + submitted.stderr)
    jobs = re.findall(r": job (\d+)", submitted.stdout)
    if submitted.returncode or not jobs:
        raise RuntimeError(f"submit failed (exit {submitted.returncode})")
    job, run = jobs[-1], runs / "tiny_cpu"
    attempts = lambda: [json.loads(x) for x in (run / "jobs.jsonl").read_text().splitlines()] if (run / "jobs.jsonl").exists() else []  # noqa: E731
    last_step = lambda: max([r["step"] for r in read_metrics(run)], default=0)  # noqa: E731
    wait_for(lambda: last_step() >= 10, f"job {job} logged no 10 steps", 1800)  # the queue, the image, the rendezvous
    signalled_at, sent = last_step(), time.time()
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    wait_for(lambda: attempts() and "ended" in attempts()[0], f"job {job}'s first attempt did not end", 900)
    stop = attempts()[0]
    stop_seconds = time.time() - sent
    wait_for(lambda: len(attempts()) == 2 and "ended" in attempts()[1], f"job {job} was not requeued and finished", 1800)
    first, second = attempts()
    log = (logs / f"tiny_cpu-{job}.out").read_text()
    manifest = (run / f"iter_{first['end_step']:07d}" / "files.json").is_file()
    resumed = second["start_step"] == first["end_step"] >= signalled_at and second["end_step"] == steps
    record(f"{nodes}-node job: the time-limit stop", f"exit {first['exit_code']}, {first['ended']}/{first['next']}, "
           f"checkpoint at step {first['end_step']} complete: {manifest}, {stop_seconds:.0f} s after the signal"[:100],
           "exit 0, requeued, manifest", first["exit_code"] == 0 and first["next"] == "requeued" and manifest)
    record(f"{nodes}-node job: the requeued attempt", f"resumed at step {second['start_step']}, ended {second['ended']} at "
           f"{second['end_step']}", f"resumes there, finishes {steps}", resumed and second["ended"] == "finished")
    world = nodes * torch.cuda.device_count()
    record(f"{nodes}-node job: every rank in the run", f"'world {world} ' in the banner: {f'world {world} ' in log}",
           f"{world} ranks", f"world {world} " in log)
    transport = "NET/IB" if "NET/IB" in log else "NET/Socket" if "NET/Socket" in log else "not in the log"
    record(f"{nodes}-node job: NCCL's transport between nodes", transport, "NET/IB on an InfiniBand cluster")
    print(f"first attempt: {stop}; second: {second}")


# ---------------------------------------------------------------- 6. summary
def summary() -> int:
    header = ("check", "value", "tolerance / goal", "result")
    width = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, width)).rstrip()  # noqa: E731
    print("\n" + line(header) + "\n" + "  ".join("-" * w for w in width))
    for r in rows:
        print(line(r))
    from fbt_megatron.launch.rehearsal.report import verdict

    failed = [r for r in rows if r[3] == "FAIL"]
    print("\n" + verdict(len(failed), [r[0] for r in rows if r[3] == "SKIP"]))
    return 1 if failed else 0


def guarded(check, fn, *args):
    """Run one section; an exception is a failed check (with its traceback), and the run goes on."""
    try:
        fn(*args)
    except Exception as e:
        traceback.print_exc()
        free()
        record(check, f"{type(e).__name__}: {' '.join(str(e).split())}"[:100], "runs", False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-perf", action="store_true", help="skip the fbt-1b throughput/memory section")
    parser.add_argument("--skip-multi-gpu", action="store_true", help="skip the TP=2 run even with 2+ GPUs")
    parser.add_argument("--perf-seq-length", type=int, default=4096)
    parser.add_argument("--perf-micro-batch-size", type=int, default=1)
    parser.add_argument("--perf-steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--offload-seq-length", type=int, default=32768, help="sequence of the offloading comparison")
    parser.add_argument("--kernel-seq-length", type=int, default=4096, help="sequence of the attention kernels' comparison")
    parser.add_argument("--slurm-nodes", type=int, default=0, help="submit a job of this many nodes through slurm/train.sbatch "
                        "and send it the time-limit signal mid-run (0: skip; run from a login node of the cluster)")
    parser.add_argument("--slurm-args", default="", help="more flags of `python -m fbt_megatron.slurm submit` for that job "
                        "(quoted: --partition, --account, --container-image IMAGE, ...)")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs", help="a new gpu_check-* folder here holds the TP runs")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")  # megatron-core's import notices
    code = environment()
    if code:
        return code
    for category in (UserWarning, FutureWarning, DeprecationWarning):  # megatron/TE/torch API notices
        warnings.filterwarnings("ignore", category=category)
    from fbt_megatron.common import platform

    platform.init_distributed()  # a one-process NCCL (on CPU: gloo) group + megatron parallel state (TP=1) + seeds
    guarded("TE vs local equivalence (FP32/BF16/FP8)", equivalence)
    if DEVICE != "cuda" or not TE:
        skip("attention kernels: TE BF16 vs local BF16 at the fbt-1b heads and window", NO_GPU if DEVICE != "cuda" else NO_TE)
    else:
        guarded("attention kernels (TE BF16 vs local BF16)", attention_kernels, args.kernel_seq_length)
    if args.skip_perf:
        record("fbt-1b performance", "skipped (--skip-perf)", "-", "SKIP")
    elif DEVICE != "cuda":
        skip("fbt-1b performance (tokens/s, MFU, peak memory vs the planner)", NO_GPU)
        skip("offloading recompute inputs at long context", NO_GPU)
    else:
        guarded("fbt-1b performance", performance, args.perf_seq_length, args.perf_micro_batch_size, args.perf_steps)
        if TE:
            guarded("offloading recompute inputs", offloading, args.offload_seq_length, 3)
        else:  # the local spec's s x s attention scores at 32K: 64 GiB per layer
            skip("offloading recompute inputs at long context", "the local spec's attention scores do not fit at "
                 f"{args.offload_seq_length}; " + NO_TE)
    if args.skip_multi_gpu:
        record("multi-GPU", "skipped (--skip-multi-gpu)", "-", "SKIP")
    else:
        guarded("multi-GPU vs 1 GPU (entry point, NCCL)", multi_gpu, args.workdir.resolve())
    if DEVICE != "cuda" or args.slurm_nodes < 1:
        skip("multi-node job through slurm/train.sbatch with the time-limit signal",
             NO_GPU if DEVICE != "cuda" else "give --slurm-nodes 2 (and --slurm-args) on a Slurm cluster")
    else:
        guarded("multi-node job through slurm/train.sbatch", slurm_job, args.workdir.resolve(), args.slurm_nodes,
                shlex.split(args.slurm_args))
    code = summary()
    torch.distributed.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
