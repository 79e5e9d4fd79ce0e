"""Linear probes per layer on a state-tracking run (the paper's Sec. 4.4): how well the task's state
(the label at position t: the state after the inputs up to t) can be read linearly from each
layer's output, in the standard forward (pass 1) and after n fused prefill passes (the last
pass's hidden states). Layer 0 is the input of the stack (e_t in pass 1, u_t where fused), layer l
the residual stream after layer l (layer L: the top state before the final norm).

The probe is multinomial logistic regression on standardised features (mean and deviation of the
probe's training positions), fit by L-BFGS in float64 from zero weights with a small L2 penalty:
deterministic. Probes are fit on sequences from the task's training generator and scored on
sequences of its test generator (a seed no training sequence uses), at every position."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from fbt_megatron.evaluation.diagnostics import common


def layer_outputs(model, tokens: torch.Tensor, pass_indices: Sequence[int], chunk: int = 64) -> Dict[int, torch.Tensor]:
    """{j: [L + 1, b·s, h] float32}: the input of the stack and every layer's output (forward hooks on
    ``model.decoder.layers``) in pass j of the eval-mode forward (``tasks.evaluate.pass_logits``),
    rows in the order of ``tokens`` [b, s] flattened."""
    from fbt_megatron.evaluation.tasks.evaluate import pass_logits

    layers = list(model.decoder.layers)
    captured: List[Optional[torch.Tensor]] = [None] * (len(layers) + 1)

    def keep(index):
        def hook(module, args, kwargs, output):
            captured[index + 1] = (output[0] if isinstance(output, tuple) else output).detach()
        return hook

    def keep_input(module, args, kwargs):
        captured[0] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach()

    handles = [layers[0].register_forward_pre_hook(keep_input, with_kwargs=True)]
    handles += [layer.register_forward_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    wanted, last = set(pass_indices), max(pass_indices)
    out: Dict[int, List[torch.Tensor]] = {j: [] for j in wanted}
    try:
        model.eval()
        with torch.no_grad():
            for start in range(0, len(tokens), chunk):
                for j, _ in enumerate(pass_logits(model, tokens[start:start + chunk], last), start=1):
                    if j in wanted:  # [L + 1, s, b, h] → [L + 1, b·s, h]
                        stacked = torch.stack(captured).transpose(1, 2)
                        out[j].append(stacked.reshape(stacked.shape[0], -1, stacked.shape[-1]).float())
    finally:
        for handle in handles:
            handle.remove()
    return {j: torch.cat(parts, dim=1) for j, parts in out.items()}


class Probe:
    """Multinomial logistic regression x ↦ argmax(W·(x − μ)/σ + b)."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor, classes: int, l2: float = 1e-4, max_iter: int = 200):
        x = features.double()
        self.mean, self.std = x.mean(0), x.std(0).clamp(min=1e-8)
        x = (x - self.mean) / self.std
        self.weight = torch.zeros(x.shape[1], classes, dtype=torch.float64, requires_grad=True)
        self.bias = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([self.weight, self.bias], lr=1, max_iter=max_iter, history_size=20,
                                      tolerance_grad=1e-10, tolerance_change=1e-12, line_search_fn="strong_wolfe")

        def closure():
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(x @ self.weight + self.bias, labels) + l2 * self.weight.pow(2).sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            optimizer.step(closure)
        self.weight, self.bias = self.weight.detach(), self.bias.detach()

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        return (((features.double() - self.mean) / self.std) @ self.weight + self.bias).argmax(-1)

    def accuracy(self, features: torch.Tensor, labels: torch.Tensor) -> float:
        return (self.predict(features) == labels).double().mean().item()


def probes(run, fused_passes: Optional[Sequence[int]] = None, train_sequences: int = 256, test_sequences: int = 256,
           length: Optional[int] = None, l2: float = 1e-4, max_iter: int = 200) -> dict:
    """Test accuracy of a probe per layer and mode: "standard" (pass 1) and "n fused" (pass n + 1)
    for each n in ``fused_passes`` (default: 1 … the run's ``--fused-prefill-passes``, none for a baseline)."""
    from fbt_megatron.data.state_tracking import SPLIT_SEEDS

    task = common.state_tracking_task(run, "probes")
    latent = run.model.config.latent_feedback
    if fused_passes is None:
        fused_passes = list(range(1, run.recipe.training.fused_prefill_passes + 1)) if latent else []
    fused_passes = sorted(set(fused_passes))
    if any(n < 1 for n in fused_passes):
        raise ValueError(f"--fused-passes must be >= 1 (0 is the standard mode, always probed), got {fused_passes}")
    if fused_passes and not latent:
        raise ValueError(f"probes after fused passes need a run with latent feedback; {run.folder} is a baseline")
    common.positive(train_sequences, "--train-sequences")
    common.positive(test_sequences, "--test-sequences")
    length = common.positive(length, "--length") or task.seq_length
    modes = {"standard": 1, **{f"{n} fused": n + 1 for n in fused_passes}}

    data = {}
    for split, count in (("train", train_sequences), ("test", test_sequences)):
        tokens, labels = task.group.sample(count, length, SPLIT_SEEDS[split])
        data[split] = (layer_outputs(run.model, torch.from_numpy(tokens), sorted(set(modes.values()))),
                       torch.from_numpy(labels).reshape(-1))
    num_layers = len(run.model.decoder.layers)
    accuracy = {}
    bar = common.progress(total=len(modes) * (num_layers + 1), desc="probes", unit="probe")
    for mode, j in modes.items():
        accuracy[mode] = []
        for layer in range(num_layers + 1):
            probe = Probe(data["train"][0][j][layer], data["train"][1], task.group.size, l2, max_iter)
            accuracy[mode].append(probe.accuracy(data["test"][0][j][layer], data["test"][1]))
            bar.update()
    bar.close()
    return {
        "run": run.folder, "iteration": run.iteration, "task": task.group.name, "chance": 1 / task.group.size,
        "train_length": task.seq_length, "length": length, "train_sequences": train_sequences,
        "test_sequences": test_sequences, "layers": list(range(num_layers + 1)),
        "layer_names": ["input"] + [f"layer {l}" for l in range(1, num_layers + 1)],
        "accuracy": accuracy,  # mode → test accuracy per layer (index 0: the stack's input)
    }


def summary(result: dict) -> str:
    head = ["mode", *result["layer_names"]]
    lines = [f"probes: {result['run']} ({result['task']}, chance {result['chance']:.2f}), linear probes on "
             f"{result['train_sequences']} × {result['length']} positions, test accuracy on {result['test_sequences']} sequences",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, row in result["accuracy"].items():
        lines.append("| " + " | ".join([mode, *[f"{a:.3f}" for a in row]]) + " |")
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, row in result["accuracy"].items():
        ax.plot(result["layers"], row, marker="o", label=mode)
    ax.axhline(result["chance"], linestyle=":", color="gray", label="chance")
    ax.set_xticks(result["layers"], ["in"] + [str(l) for l in result["layers"][1:]])
    ax.set(xlabel="layer", ylabel="probe test accuracy", ylim=(0, 1.02),
           title=f"{common.Path(result['run']).name}: linear probes for the {result['task']} state")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
