"""The CPU main job: what latent feedback buys, on a model small enough for a laptop.

Prepares the embedded corpus (Python's standard library) if needed, trains the baseline
(``recipes/tiny_cpu_baseline.yaml``) and the FBT model (``recipes/tiny_cpu.yaml``) with the same
data, steps and seed, then prints and writes (``<output>/results.md``, ``<output>/results.png``)
the validation loss of the baseline and of the FBT model after 0, 1, 2, 3 fused prefill passes,
with each run's tokens/s. ``--twice-tokens`` adds the paper's headline comparison: the baseline
trained on twice the tokens. Finished runs are reused; interrupted ones resume.

    python tools/demo.py                      # a few minutes per model
    python tools/demo.py --train-iters 2000   # longer
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FBT, BASELINE = ROOT / "recipes" / "tiny_cpu.yaml", ROOT / "recipes" / "tiny_cpu_baseline.yaml"


def train(name: str, recipe: Path, iters: int, folder: Path, threads: int) -> float:
    """Train (or resume, or reuse) one run through the training entry point; returns seconds."""
    from fbt_megatron.checkpointing import latest_iteration

    if latest_iteration(folder) == iters:
        print(f"[{name}] finished before: reusing {folder}", flush=True)
        return 0.0
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fbt_megatron.train", "--recipe", str(recipe), "--train-iters", str(iters),
           "--save", str(folder), "--load", str(folder), "--threads", str(threads)]
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT) as proc:
        for line in proc.stdout:  # the run's periodic log lines show it is alive
            print(f"[{name}] {line}", end="", flush=True)
    if proc.returncode:
        raise RuntimeError(f"training {name} failed (exit {proc.returncode}); its log is above")
    return time.perf_counter() - start


def summarize(name: str, folder: Path, seconds: float) -> dict:
    from fbt_megatron.metrics import read_metrics

    records = read_metrics(folder)
    last_valid = [r for r in records if "valid_loss_fused0" in r][-1]
    valid = [last_valid[k] for k in sorted(last_valid) if k.startswith("valid_loss_fused")]
    return {
        "name": name,
        "records": records,
        "valid": valid,
        "tokens": records[-1]["tokens"],
        "compute_tokens": records[-1]["compute_tokens"],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
        "seconds": seconds,
    }


def table(runs: list, passes: int) -> str:
    head = ["model", "train tokens", "compute tokens", "tokens/s"] + [f"valid loss, {j} fused" for j in range(passes + 1)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        valid = [f"{r['valid'][j]:.4f}" if j < len(r["valid"]) else "–" for j in range(passes + 1)]
        row = [r["name"], f"{r['tokens']:,}", f"{r['compute_tokens']:,}", f"{r['tokens_per_s']:,.0f}", *valid]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(runs: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        steps = [x["tokens"] for x in r["records"]]
        curves.plot(steps, [x["pass_losses"][0] for x in r["records"]], label=f"{r['name']} (train, pass 1)", alpha=0.6)
        evals = [x for x in r["records"] if "valid_loss_fused0" in x]
        for j in range(len(r["valid"])):
            curves.plot([x["tokens"] for x in evals], [x[f"valid_loss_fused{j}"] for x in evals], "o--",
                        label=f"{r['name']} (valid, {j} fused)")
    curves.set_xlabel("training tokens")
    curves.set_ylabel("loss (nats/token)")
    curves.legend(fontsize=7)
    curves.set_title("loss while training")
    labels, values = [], []
    for r in runs:
        for j, v in enumerate(r["valid"]):
            labels.append(f"{r['name']}\n{j} fused" if len(r["valid"]) > 1 else r["name"])
            values.append(v)
    bars.bar(range(len(values)), values, color=["C0" if "baseline" in l else "C1" for l in labels])
    bars.set_xticks(range(len(values)), labels, fontsize=7)
    low = min(values)
    bars.set_ylim(low - 0.1 * (max(values) - low + 0.05), max(values) + 0.02)
    for i, v in enumerate(values):
        bars.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=7)
    bars.set_title("final validation loss")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=None, help="steps per model (default: the recipes')")
    parser.add_argument("--twice-tokens", action="store_true", help="also train the baseline on twice the tokens")
    parser.add_argument("--output", default="runs/demo", help="folder for the runs and results")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)

    from fbt_megatron.data.corpus import ensure_corpus
    from fbt_megatron.recipe import load_recipe

    fbt_recipe = load_recipe(str(FBT))
    iters = args.train_iters or fbt_recipe.training.train_iters
    if iters < 1:
        raise ValueError(f"--train-iters must be >= 1, got {iters}")
    start = time.perf_counter()
    d = fbt_recipe.data
    ensure_corpus(d.corpus, str(ROOT / d.data_path), vocab_size=d.vocab_size)
    out = ROOT / args.output
    plan = [("baseline", BASELINE, iters), ("FBT", FBT, iters)]
    if args.twice_tokens:
        plan.append(("baseline 2x tokens", BASELINE, 2 * iters))
    runs = []
    for name, recipe, n in plan:
        folder = out / f"{name.replace(' ', '_')}-{n}"
        runs.append(summarize(name, folder, train(name, recipe, n, folder, args.threads)))

    passes = fbt_recipe.training.fused_prefill_passes
    text = table(runs, passes)
    minutes = (time.perf_counter() - start) / 60
    note = (f"\n\n{iters} steps per model, {fbt_recipe.training.global_batch_size} × {d.seq_length} tokens per step; "
            f"validation on held-out files of the corpus; {minutes:.1f} min in all on this machine.\n")
    (out / "results.md").write_text(text + note)
    plot(runs, out / "results.png")
    print("\n" + text + note)
    print(f"wrote {out / 'results.md'} and {out / 'results.png'}")
    return 0


if __name__ == "__main__":
    from fbt_megatron.cli import run_cli

    run_cli(main)
