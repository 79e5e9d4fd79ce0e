"""Compare what equivalence_worker.py wrote at two parallel layouts, tensor by tensor, at TP=PP=1."""

import json
from pathlib import Path

import torch


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |a| (0 when both are zero or empty)."""
    if a.numel() == 0 and b.numel() == 0:
        return 0.0
    scale = a.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def tensors(folder, model_args: dict, prefix: str = "") -> dict:
    """The model's tensors in the checkpoint ``folder`` (those under the key ``prefix``), by name."""
    from megatron.core import dist_checkpointing

    from fbt_megatron.config import make_config
    from fbt_megatron.model import FBTModel

    model = FBTModel(make_config("tiny", **model_args))
    state = dist_checkpointing.load(model.sharded_state_dict(prefix=prefix), str(folder))
    return {k[len(prefix):]: v for k, v in state.items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}


def compare(reference, other) -> dict:
    """Worst relative difference of per-pass losses and state deltas, first-step gradients and the weights after
    two steps, per trial (recompute mode × k) that ``other`` ran."""
    reference, other = Path(reference), Path(other)
    model_args = json.loads((reference / "model.json").read_text())
    ref = {kind: json.loads((reference / f"{kind}.json").read_text()) for kind in ("losses", "deltas")}
    got = {kind: json.loads((other / f"{kind}.json").read_text()) for kind in ("losses", "deltas")}
    out = {}
    for trial in sorted(got["losses"]):
        worst = {kind: relative(torch.tensor(ref[kind][trial]), torch.tensor(got[kind][trial])) for kind in ("losses", "deltas")}
        for kind in ("grads", "params"):
            a, b = tensors(reference / trial, model_args, f"{kind}."), tensors(other / trial, model_args, f"{kind}.")
            assert sorted(a) == sorted(b)
            worst[kind] = max(relative(a[name], b[name]) for name in a)
        out[trial] = worst
    return out
