"""Compare runs at two parallel layouts: what equivalence_worker.py wrote, tensor by tensor, at TP=PP=1
(``compare``); what the training entry point logged (``worst_difference`` of its ``metrics.jsonl``
records, for runs with the ``ENTRY`` flags)."""

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

    from fbt_megatron.model.config import make_config
    from fbt_megatron.model.fbt_model import FBTModel

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


# ---------------------------------------------------------------- the entry point's logs
ENTRY = [
    "--recipe", "recipes/tiny_cpu.yaml", "--threads", "1", "--seq-length", "64", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--train-iters", "6", "--lr-warmup-iters", "1", "--log-interval", "1",
    "--eval-interval", "3", "--eval-iters", "1", "--save-interval", "3", "--tensorboard", "false",
    "--pass-phases", "[{start: 0.0, mixture: {1: 0.4, 2: 0.3, 3: 0.3}}]",
]


def corpus_flags(corpus) -> list:
    return ["--data-path", str(Path(corpus.train_prefix).parent), "--corpus", "null"]


def worst_difference(expected: list, got: list) -> float:
    """Largest relative difference over steps of loss, per-pass losses, ‖Δs‖, grad norm, validation."""
    assert [r["step"] for r in expected] == [r["step"] for r in got] and [r["k"] for r in expected] == [r["k"] for r in got]
    worst = 0.0
    for e, g in zip(expected, got):
        keys = ["loss", "grad_norm"] + [key for key in e if key.startswith("valid_loss")]
        assert len(e["state_deltas"]) == len(g["state_deltas"]) == e["k"] - 1
        pairs = [(e[key], g[key]) for key in keys] + list(zip(e["pass_losses"], g["pass_losses"]))
        pairs += list(zip(e["state_deltas"], g["state_deltas"]))
        worst = max([worst] + [abs(a - b) / abs(a) for a, b in pairs])
    return worst
