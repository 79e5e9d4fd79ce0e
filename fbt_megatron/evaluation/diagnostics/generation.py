"""State-tracking accuracy under real decoding with the KV cache (``fbt_megatron.generate``):
standard, soft and fused(n) decoding of test sequences max(lengths) × the training length long.
The first ``prompt_length`` inputs are the prompt; the rest are fed through decoding one position
at a time (teacher-forced: ``forced_logits``), each mode building its inputs its own way. The
prediction at position t is scored against the state after the inputs up to t, at every position,
and reported per bucket of positions as ``tasks.evaluate`` buckets them (up to 1×, (1×, 2×], …).
Prompt positions before the last one are the prompt's forward in the mode's pass (pass 1 for
standard and soft, pass n + 1 for fused(n)), which is what decoding computes there.

With a one-token prompt, soft decoding is the full recurrence of ``tasks.evaluate``; standard
decoding is its "0 fused" at any prompt length."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from fbt_megatron.evaluation.diagnostics import common


def mode_names(latent: bool, fused_passes: Sequence[int]) -> Dict[str, dict]:
    """{name: forced_logits arguments} of the modes decoded."""
    modes = {"standard": dict(mode="standard")}
    if latent:
        modes["soft"] = dict(mode="soft")
        modes.update({f"fused({n})": dict(mode="fused", fused_passes=n) for n in fused_passes})
    return modes


def decoded_accuracy(model, tokens: torch.Tensor, labels: torch.Tensor, prompt_length: int, use_cache: bool = True,
                     batch: int = 64, **mode) -> List[float]:
    """Accuracy at each position of ``tokens``/``labels`` [b, T] decoded in ``mode`` (forced_logits' arguments)."""
    from fbt_megatron.evaluation.tasks.evaluate import pass_logits
    from fbt_megatron.inference.generate import forced_logits

    length = tokens.shape[1]
    prompt_pass = mode.get("fused_passes", 0) + 1 if mode["mode"] == "fused" else 1
    correct = torch.zeros(length)
    for start in range(0, len(tokens), batch):
        x, y = tokens[start:start + batch], labels[start:start + batch]
        logits = forced_logits(model, x[:, :prompt_length].tolist(), x[:, prompt_length:].tolist(),
                               use_cache=use_cache, max_length=length, **mode)
        decoded = torch.stack([l.argmax(-1) for l in logits])  # [b, T − p + 1]: positions p − 1 … T − 1
        correct[prompt_length - 1:] += (decoded == y[:, prompt_length - 1:]).float().sum(0)
        if prompt_length > 1:
            with torch.no_grad():
                for j, prompt_logits in enumerate(pass_logits(model, x[:, :prompt_length - 1], prompt_pass), start=1):
                    if j == prompt_pass:
                        correct[:prompt_length - 1] += (prompt_logits.argmax(-1) == y[:, :prompt_length - 1]).float().sum(0)
    return (correct / len(tokens)).tolist()


def generation(run, fused_passes: Sequence[int] = (1, 2, 3), lengths: Sequence[int] = (1, 2, 4),
               prompt_length: Optional[int] = None, sequences: int = 64, use_cache: bool = True) -> dict:
    from fbt_megatron.data.state_tracking import SPLIT_SEEDS
    from fbt_megatron.evaluation.tasks.evaluate import bucket_accuracy

    task = common.state_tracking_task(run, "generation")
    latent = run.model.config.latent_feedback
    lengths = list(lengths)
    if not lengths or any(m < 1 for m in lengths) or lengths != sorted(set(lengths)):
        raise ValueError(f"--lengths must be increasing multiples >= 1 of the training length, got {lengths}")
    fused_passes = sorted(set(fused_passes))
    if any(n < 1 for n in fused_passes):
        raise ValueError(f"--fused-passes must be >= 1 (fused(0) is soft decoding, always run), got {fused_passes}")
    if fused_passes and not latent:
        raise ValueError(f"fused decoding needs a run with latent feedback; {run.folder} is a baseline "
                         "(give --fused-passes with no values for standard decoding alone)")
    common.positive(sequences, "--sequences")
    length = lengths[-1] * task.seq_length
    prompt_length = common.positive(prompt_length, "--prompt-length") or max(1, task.seq_length // 2)
    if prompt_length >= length:
        raise ValueError(f"--prompt-length {prompt_length} leaves nothing to decode in sequences of length {length}")
    tokens, labels = (torch.from_numpy(a) for a in task.group.sample(sequences, length, SPLIT_SEEDS["test"]))
    by_position = {}
    modes = mode_names(latent, fused_passes)
    for name, mode in common.progress(modes.items(), desc="decoding modes", unit="mode"):
        by_position[name] = decoded_accuracy(run.model, tokens, labels, prompt_length, use_cache, **mode)
    return {
        "run": run.folder, "iteration": run.iteration, "task": task.group.name, "chance": 1 / task.group.size,
        "train_length": task.seq_length, "test_length": length, "prompt_length": prompt_length,
        "sequences": sequences, "use_cache": use_cache,
        "accuracy": {name: bucket_accuracy(acc, task.seq_length, lengths) for name, acc in by_position.items()},
        "by_position": by_position,
    }


def summary(result: dict) -> str:
    from fbt_megatron.evaluation.tasks.evaluate import format_table

    return (f"generation: {result['run']} ({result['task']}, chance {result['chance']:.2f}), trained at length "
            f"{result['train_length']}; {result['sequences']} test sequences of length {result['test_length']}, "
            f"prompt {result['prompt_length']} tokens, the rest decoded{' with the KV cache' if result['use_cache'] else ' without cache'}\n"
            + format_table(result))


def plot(result: dict, path) -> None:
    plt = common.pyplot()
    fig, (ax_bucket, ax_position) = plt.subplots(1, 2, figsize=(11, 4))
    from fbt_megatron.evaluation.tasks.evaluate import bucket_labels

    buckets = list(next(iter(result["accuracy"].values())))
    width = 0.8 / len(result["accuracy"])
    for i, (name, row) in enumerate(result["accuracy"].items()):
        ax_bucket.bar([b + i * width for b in range(len(buckets))], [row[k] for k in buckets], width, label=name, color=f"C{i}")
        ax_position.plot(range(1, result["test_length"] + 1), result["by_position"][name], label=name, color=f"C{i}", lw=1)
    ax_bucket.set_xticks([b + 0.4 - width / 2 for b in range(len(buckets))], bucket_labels(buckets, result["train_length"]), fontsize=8)
    for ax in (ax_bucket, ax_position):
        ax.axhline(result["chance"], linestyle=":", color="gray", label="chance")
        ax.set(ylim=(0, 1.02), ylabel="accuracy")
        ax.grid(True, alpha=0.3)
    for m in range(1, result["test_length"] // result["train_length"] + 1):
        ax_position.axvline(m * result["train_length"] + 0.5, color="black", lw=0.5, alpha=0.4)
    ax_position.axvline(result["prompt_length"] + 0.5, color="red", lw=0.8, linestyle="--", label="end of prompt")
    ax_bucket.set(title="accuracy by position bucket")
    ax_position.set(xlabel="position", title="accuracy by position")
    ax_bucket.legend(fontsize=8)
    fig.suptitle(f"{common.Path(result['run']).name}: {result['task']} under decoding "
                 f"(prompt {result['prompt_length']}, trained at {result['train_length']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
