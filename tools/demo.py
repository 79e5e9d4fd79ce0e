"""The CPU main job: what latent feedback does on models small enough for a laptop.

Two comparisons, each of a baseline and an FBT model trained with the same data, steps and seed:

  * language modelling: ``recipes/tiny_cpu_baseline.yaml`` against ``recipes/tiny_cpu.yaml`` on the
    embedded corpus (Python's standard library, prepared first if needed): the validation loss of
    the baseline and of FBT after 0, 1, 2, 3 fused prefill passes;
  * state tracking (``fbt_megatron.tasks``): ``recipes/state_tracking_{baseline,fbt}.yaml`` on
    running parity, for several seeds: accuracy by position up to 4× the training length, for the
    baseline, FBT after 0 … 3 fused passes and FBT with the full recurrence.

Runs go ``--jobs`` at a time (default: one per core, one thread each), each with a progress bar
(step, loss, tokens/s); the full log of a run is ``<run>/train.log``. An overall bar estimates the
time left. Results: ``<output>/results.md`` (tables, and what the numbers show) and
``<output>/results.png``. Finished runs are reused; interrupted ones resume.

    python tools/demo.py                                   # about 11 minutes on 2 cores
    python tools/demo.py --train-iters 3000 --twice-tokens # longer, and the baseline on twice the tokens
    python tools/demo.py --tasks parity sum_mod5 s3 --seeds 5
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional

from tqdm import tqdm

from fbt_megatron.cli import quiet_library_warnings, run_cli
from fbt_megatron.tasks.evaluate import FULL, bucket_labels

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
FBT, BASELINE = RECIPES / "tiny_cpu.yaml", RECIPES / "tiny_cpu_baseline.yaml"
TASK_FBT, TASK_BASELINE = RECIPES / "state_tracking_fbt.yaml", RECIPES / "state_tracking_baseline.yaml"
PAPER = "1B parameters trained on 100B tokens"
STEP_LINE = re.compile(r"^step\s+(\d+)\b")


# ---------------------------------------------------------------- the runs
@dataclass
class Run:
    """One training run through the entry point, and for a task its evaluation."""

    label: str  # "baseline", "FBT", "parity FBT seed 2", ...
    model: str  # "baseline", "FBT" or "baseline 2x tokens": what the results group by
    recipe: Path
    iters: int
    folder: Path
    flags: List[str] = field(default_factory=list)  # training flags besides recipe, steps and folders
    task: Optional[str] = None  # a state-tracking task: evaluated after training
    train_work: float = 0.0  # expected cost of training, in layer-tokens: the overall ETA's unit
    eval_work: float = 0.0  # and of the evaluation


def _layers_and_latent(recipe) -> tuple:
    from fbt_megatron.config import make_config

    config = make_config(recipe.model.preset, **recipe.model_overrides)
    return config.num_layers, config.latent_feedback


def training_work(recipe_path: Path, iters: int) -> float:
    """Layer-tokens a run processes: steps × tokens per step × mean passes per step × layers."""
    from fbt_megatron.recipe import load_recipe

    r = load_recipe(str(recipe_path))
    layers, _ = _layers_and_latent(r)
    passes = sum(k * n for k, n in pass_mixture(recipe_path, iters).items())
    return layers * passes * r.training.global_batch_size * r.data.seq_length


def pass_mixture(recipe_path: Path, iters: int) -> Dict[int, float]:
    """How many of a run's ``iters`` steps are expected to have each k (its pass schedule)."""
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.passes import pass_schedule

    r = load_recipe(str(recipe_path))
    r.training.train_iters = iters
    return pass_schedule(r).expected_passes(iters)


def evaluation_work(recipe_path: Path, sequences: int, length: int) -> float:
    """Layer-tokens of the state-tracking evaluation (T passes over T positions for FBT's full
    recurrence), at a third of the training cost per token: forward only."""
    from fbt_megatron.recipe import load_recipe

    layers, latent = _layers_and_latent(load_recipe(str(recipe_path)))
    return layers * (length if latent else 1) * sequences * length / 3


def parse_step(line: str) -> Optional[dict]:
    """A training log line ``step N | k .. | loss X | ... | N tok/s ...`` → {step, loss, tokens/s}."""
    m = STEP_LINE.match(line)
    if not m:
        return None
    loss = re.search(r"\| loss ([\d.]+)", line)
    speed = re.search(r"([\d,]+) tok/s", line)
    return {
        "step": int(m.group(1)),
        "loss": float(loss.group(1)) if loss else None,
        "tokens_per_s": int(speed.group(1).replace(",", "")) if speed else None,
    }


class Runner:
    """Runs ``jobs`` subprocesses at a time, each with its own progress bar under an overall one."""

    def __init__(self, runs: List[Run], jobs: int, threads: int, eval_sequences: int, eval_lengths: List[int]):
        self.runs, self.jobs, self.threads = runs, jobs, threads
        self.eval_sequences, self.eval_lengths = eval_sequences, eval_lengths
        self.slots = queue.Queue()
        for slot in range(jobs):
            self.slots.put(slot + 1)  # bar positions under the overall bar
        self.done, self.reused = 0, 0
        self.lock = threading.Lock()
        self.overall = tqdm(total=round(sum(r.train_work + r.eval_work for r in runs)), desc=f"runs 0/{len(runs)} done",
                            bar_format="{desc} |{bar}| {percentage:3.0f}% [{elapsed} elapsed, about {remaining} left]")

    def advance(self, work: float) -> None:
        with self.lock:
            self.overall.update(round(work))

    def run_all(self) -> None:
        with ThreadPoolExecutor(self.jobs) as pool:
            futures = [pool.submit(self.one, run) for run in self.runs]
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in finished if f.exception() is not None]
            if failed:
                for f in futures:
                    f.cancel()  # those not started yet; running ones finish
                raise failed[0].exception()
        self.overall.close()

    def one(self, run: Run) -> None:
        slot = self.slots.get()
        try:
            start = time.perf_counter()
            reused = self.train(run, slot)
            if run.task is not None:
                self.evaluate(run, slot)
            with self.lock:
                self.done += 1
                self.reused += reused
                self.overall.set_description_str(f"runs {self.done}/{len(self.runs)} done")
                note = "finished before: reused" if reused else f"done in {(time.perf_counter() - start) / 60:.1f} min"
                tqdm.write(f"[{run.label}] {note} ({run.folder})")
        finally:
            self.slots.put(slot)

    def command(self, *args) -> list:
        return [sys.executable, *args, "--threads", str(self.threads)]

    def train(self, run: Run, slot: int) -> bool:
        """Train (or resume) ``run``; False if it had finished before (nothing to do)."""
        from fbt_megatron.checkpointing import latest_iteration

        if latest_iteration(run.folder) == run.iters:
            self.advance(run.train_work)
            return True
        run.folder.mkdir(parents=True, exist_ok=True)
        (run.folder / "eval.json").unlink(missing_ok=True)  # a resumed run is evaluated afresh
        cmd = self.command("-m", "fbt_megatron.train", "--recipe", str(run.recipe), "--train-iters", str(run.iters),
                           "--save", str(run.folder), "--load", str(run.folder), *run.flags)
        per_step = run.train_work / run.iters
        bar = tqdm(total=run.iters, desc=f"{run.label:<22}", position=slot, leave=False, unit="step")
        log = run.folder / "train.log"
        with open(log, "a") as out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     text=True, cwd=ROOT) as proc:
            out.write("$ " + " ".join(cmd[1:]) + "\n")
            for line in proc.stdout:
                out.write(line)
                step = parse_step(line)
                if step is not None:
                    self.advance(per_step * (step["step"] - bar.n))
                    bar.update(step["step"] - bar.n)
                    bar.set_postfix(loss=step["loss"], tok_s=step["tokens_per_s"])
        bar.close()
        if proc.returncode:
            tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
            raise RuntimeError(f"training {run.label} failed (exit {proc.returncode}); the end of {log}:\n{tail}")
        return False

    def evaluate(self, run: Run, slot: int) -> None:
        """Accuracy by position of a task run (``fbt_megatron.tasks.evaluate``), into <run>/eval.json
        (kept while the run is: training removes it)."""
        result = run.folder / "eval.json"
        if result.is_file():
            self.advance(run.eval_work)
            return
        bar = tqdm(total=1, desc=f"{run.label:<22}", position=slot, leave=False, bar_format="{desc} evaluating… {elapsed}")
        cmd = self.command("-m", "fbt_megatron.tasks.evaluate", "--recipe", str(run.recipe), "--load", str(run.folder),
                           "--sequences", str(self.eval_sequences), "--lengths", *map(str, self.eval_lengths),
                           "--json", str(result), *run.flags)
        with open(run.folder / "eval.log", "w") as out:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        bar.close()
        if code:
            raise RuntimeError(f"evaluating {run.label} failed (exit {code}); see {run.folder / 'eval.log'}")
        self.advance(run.eval_work)


# ---------------------------------------------------------------- language modelling: numbers and words
def summarize_lm(run: Run) -> dict:
    from fbt_megatron.metrics import read_metrics

    records = read_metrics(run.folder)
    last_valid = [r for r in records if "valid_loss_fused0" in r][-1]
    return {
        "name": run.model,
        "records": records,
        "valid": [last_valid[k] for k in sorted(last_valid) if k.startswith("valid_loss_fused")],
        "tokens": records[-1]["tokens"],
        "compute_tokens": records[-1]["compute_tokens"],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
    }


def lm_table(runs: list, passes: int) -> str:
    head = ["model", "train tokens", "compute tokens", "tokens/s"] + [f"valid loss, {j} fused" for j in range(passes + 1)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        valid = [f"{r['valid'][j]:.4f}" if j < len(r["valid"]) else "–" for j in range(passes + 1)]
        row = [r["name"], f"{r['tokens']:,}", f"{r['compute_tokens']:,}", f"{r['tokens_per_s']:,.0f}", *valid]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def fused_loss_share(mixture: Dict[int, float], pass_weights=None) -> float:
    """The share of the training loss on fused passes (pass ≥ 2): a k-pass step weighs pass j by
    w_j / Σw (the mean by default), averaged over the pass mixture ({k: weight})."""
    from fbt_megatron.fbt import pass_weights as weights_of

    config = SimpleNamespace(pass_weights=pass_weights)
    share = {k: sum(weights_of(config, k)[1:]) / sum(weights_of(config, k)) for k in mixture}
    return sum(w * share[k] for k, w in mixture.items()) / sum(mixture.values())


def lm_findings(runs: list, mixture: Dict[int, float], pass_weights=None) -> str:
    """One paragraph, from the numbers, on what the language-model comparison shows at this scale."""
    base = next(r for r in runs if r["name"] == "baseline")
    fbt = next(r for r in runs if r["name"] == "FBT")
    b, f = base["valid"][0], fbt["valid"]
    worse = lambda d: "worse" if d > 0 else "better"  # noqa: E731  (loss: lower is better)
    text = (f"**What this shows.** With {fbt['tokens']:,} training tokens, FBT's standard pass (0 fused) ends at a "
            f"validation loss of {f[0]:.3f}, {abs(f[0] - b):.3f} {worse(f[0] - b)} than the baseline's {b:.3f}")
    if len(f) > 1:
        steps = ", ".join(f"{v:.3f}" for v in f[1:])
        trend = "rises" if all(y > x for x, y in zip(f, f[1:])) else "falls" if all(y < x for x, y in zip(f, f[1:])) else "moves"
        text += f"; with 1 … {len(f) - 1} fused prefill passes it {trend} to {steps}"
        evals = [r for r in fbt["records"] if "valid_loss_fused1" in r]
        gap = lambda r: r["valid_loss_fused1"] - r["valid_loss_fused0"]  # noqa: E731
        total = sum(mixture.values())
        text += (f". Under the pass mixture {{{', '.join(f'{k}: {n / total:.2f}' for k, n in sorted(mixture.items()))}}}, fused passes carry "
                 f"{fused_loss_share(mixture, pass_weights):.0%} of the training loss (a k-pass step weighs each "
                 f"pass 1/k), so at this scale they are undertrained next to the standard pass")
        if len(evals) > 1:
            change = "shrinking" if abs(gap(evals[-1])) < abs(gap(evals[0])) else "not shrinking"
            text += (f": the gap between one fused pass and none went from {gap(evals[0]):+.3f} at step "
                     f"{evals[0]['step']} to {gap(evals[-1]):+.3f} at step {evals[-1]['step']}, {change} with training")
    text += (f". The paper's claims are for {PAPER}; this run is far from that and does not test them. "
             "The state-tracking comparison below is a task where a fused pass has work to do even at this scale.")
    return text


# ---------------------------------------------------------------- state tracking: numbers and words


def task_modes(results: Dict[str, List[dict]]) -> List[tuple]:
    """(row label, model, eval mode) for every row of a task's table, baseline first."""
    rows = [("baseline", "baseline", mode) for mode in results["baseline"][0]["accuracy"]]
    rows += [(f"FBT, {mode}", "FBT", mode) for mode in results["FBT"][0]["accuracy"]]
    return rows


def spread(values: List[float]) -> str:
    """mean (min–max) over seeds."""
    return f"{statistics.mean(values):.3f}" + (f" ({min(values):.2f}–{max(values):.2f})" if len(values) > 1 else "")


def task_table(results: Dict[str, List[dict]]) -> str:
    """Accuracy per mode and position bucket: the mean over seeds (min–max)."""
    first = results["baseline"][0]
    buckets = list(first["accuracy"]["0 fused"])
    head = ["model", *bucket_labels(buckets, first["train_length"])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, model, mode in task_modes(results):
        cells = [spread([r["accuracy"][mode][b] for r in results[model]]) for b in buckets]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines)


def describe(values: List[float], chance: float) -> str:
    """Accuracies over seeds in words: at chance, right everywhere, or the mean and range."""
    if all(abs(v - chance) < 0.05 for v in values):
        return f"at chance, {spread(values)}"
    if all(v == 1.0 for v in values):
        return "right at every position in every seed"
    return spread(values)


def task_findings(task: str, results: Dict[str, List[dict]]) -> str:
    """One paragraph, from the numbers, on what a state-tracking task shows."""
    first = results["FBT"][0]
    chance, t, seeds = first["chance"], first["train_length"], len(results["FBT"])
    buckets = list(first["accuracy"][FULL])
    where = dict(zip(buckets, bucket_labels(buckets, t)))
    most = [m for m in first["accuracy"] if m != FULL][-1]  # "3 fused": the most fused passes validated
    acc = lambda model, mode, b: [r["accuracy"][mode][b] for r in results[model]]  # noqa: E731
    base = lambda b: acc("baseline", "0 fused", b)  # noqa: E731
    text = (f"**{task}, {seeds} seed{'s' if seeds > 1 else ''}, trained at length {t}, tested to length "
            f"{first['test_length']} (chance {chance:.2f}).** Within the training length the baseline is at "
            f"{spread(base(buckets[0]))}, FBT at {spread(acc('FBT', '0 fused', buckets[0]))} with no fused pass, "
            f"{spread(acc('FBT', most, buckets[0]))} after {most} passes and {spread(acc('FBT', FULL, buckets[0]))} "
            "with the full recurrence. ")
    late = lambda model, mode: [statistics.mean(r["by_position"][mode][3 * t // 4 : t]) for r in results[model]]  # noqa: E731
    text += (f"On the last quarter of the training length (positions {3 * t // 4 + 1}–{t}) the baseline is "
             f"{describe(late('baseline', '0 fused'), chance)}, FBT after {most} passes {describe(late('FBT', most), chance)} "
             f"and with the full recurrence {describe(late('FBT', FULL), chance)}. ")
    for b in buckets[1:]:
        text += (f"At {where[b]} the baseline is {describe(base(b), chance)}, FBT after {most} passes "
                 f"{describe(acc('FBT', most, b), chance)} and with the full recurrence {describe(acc('FBT', FULL, b), chance)}. ")
    last = buckets[-1]
    solved = lambda values: sum(v >= 0.95 for v in values)  # noqa: E731
    full, few, baseline = solved(acc("FBT", FULL, last)), solved(acc("FBT", most, last)), solved(base(last))
    text += (f"At ≥ 0.95 up to the longest positions ({where[last]}): FBT's full recurrence (k = T passes, the same "
             f"as running FBT position by position, each fed the previous position's final state) in {full} of "
             f"{seeds} seeds, FBT after {most} passes in {few}, the baseline in {baseline}. ")
    if full > baseline:
        text += ("A model of fixed depth has to find a shortcut for the whole prefix at once; FBT's carried state "
                 "lets it learn one step of the recurrence instead, which then runs as far as the passes go")
        text += "; a few fused passes carry the state only a few positions, so they are not enough." if few < full else "."
    elif full == baseline == 0:
        text += "Neither model learned a rule that holds beyond the training length in this budget: no win here."
    else:
        text += "FBT's full recurrence does no better than the baseline here."
    return text


# ---------------------------------------------------------------- the figure
def color(model: str, mode: Optional[str] = None):
    """One colour per model and mode on every panel: the baseline blue, FBT orange (darker with
    more fused passes), FBT's full recurrence red."""
    import matplotlib

    if model.startswith("baseline"):
        return "tab:cyan" if "2x" in model else "tab:blue"
    if mode == FULL:
        return "tab:red"
    fused = int(mode.split()[0]) if mode else 0
    return matplotlib.colormaps["Oranges"](0.45 + 0.15 * fused)


def plot(lm_runs: list, tasks: Dict[str, Dict[str, List[dict]]], path: Path):
    """The language-model panels (loss while training, final validation loss) and one panel per
    state-tracking task (accuracy by position), written to ``path``; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(13, 9.5 if tasks else 4.8))
    top, bottom = fig.subfigures(2, 1) if tasks else (fig, None)
    curves, bars = top.subplots(1, 2)
    for r in lm_runs:
        tokens = [x["tokens"] for x in r["records"]]
        curves.plot(tokens, [x["pass_losses"][0] for x in r["records"]], color=color(r["name"]), alpha=0.35,
                    label=f"{r['name']} (train, standard pass)")
        evals = [x for x in r["records"] if "valid_loss_fused0" in x]
        for j in range(len(r["valid"])):
            mode = f"{j} fused"
            curves.plot([x["tokens"] for x in evals], [x[f"valid_loss_fused{j}"] for x in evals], "o--",
                        color=color(r["name"], mode), label=f"{r['name']} (valid, {mode})" if r["name"] == "FBT" else f"{r['name']} (valid)")
    curves.set(xlabel="training tokens", ylabel="loss, nats/token (lower is better)", title="language model: loss while training")
    curves.legend(fontsize=7)
    labels, values, colors = [], [], []
    for r in lm_runs:
        for j, v in enumerate(r["valid"]):
            labels.append(f"{r['name']}\n{j} fused" if r["name"] == "FBT" else r["name"])
            values.append(v)
            colors.append(color(r["name"], f"{j} fused"))
    bars.bar(range(len(values)), values, color=colors)
    bars.set_xticks(range(len(values)), labels, fontsize=7)
    bars.set_ylim(0, max(values) * 1.12)  # from zero: bar heights are comparable
    for i, v in enumerate(values):
        bars.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=7)
    bars.set(ylabel="loss, nats/token (lower is better)", title="language model: final validation loss")
    if tasks:
        for ax, (task, results) in zip(bottom.subplots(1, len(tasks), squeeze=False)[0], tasks.items()):
            first = results["FBT"][0]
            positions = range(1, first["test_length"] + 1)
            for label, model, mode in task_modes(results):
                per_seed = [r["by_position"][mode] for r in results[model]]
                mean = [statistics.mean(v) for v in zip(*per_seed)]
                ax.plot(positions, mean, color=color(model, mode), label=label, lw=1.6 if mode == FULL else 1.0)
                if len(per_seed) > 1:
                    ax.fill_between(positions, [min(v) for v in zip(*per_seed)], [max(v) for v in zip(*per_seed)],
                                    color=color(model, mode), alpha=0.15, lw=0)
            ax.axvline(first["train_length"] + 0.5, color="gray", ls=":")
            ax.text(first["train_length"], 0.03, " training length", color="gray", fontsize=8)
            ax.axhline(first["chance"], color="gray", lw=0.8, ls="--")
            ax.set_ylim(0, 1.03)
            ax.set(xlabel="position", ylabel="accuracy (higher is better)",
                   title=f"state tracking, {task}: mean of {len(results['FBT'])} seeds (band: min–max)")
            ax.legend(fontsize=7, loc="lower left")
    fig.savefig(path, dpi=120)
    return fig


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    from fbt_megatron.data.state_tracking import GROUPS

    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=None, help="language-model steps per model (default: the recipes')")
    parser.add_argument("--twice-tokens", action="store_true", help="also train the baseline on twice the tokens")
    parser.add_argument("--tasks", nargs="*", default=["parity"], choices=sorted(GROUPS),
                        help="state-tracking tasks (default: parity; none: language modelling only)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per state-tracking task and model (default: 3)")
    parser.add_argument("--task-iters", type=int, default=None, help="state-tracking steps per model (default: the recipes')")
    parser.add_argument("--eval-sequences", type=int, default=64, help="state-tracking test sequences (default: 64)")
    parser.add_argument("--output", default="runs/demo", help="folder for the runs and results")
    parser.add_argument("--jobs", type=int, default=min(2, cores), help="runs at a time (default: one per core, at most 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: cores / jobs)")
    args = parser.parse_args(argv)
    quiet_library_warnings()  # megatron-core's API notices when recipes are read

    from fbt_megatron.data.corpus import ensure_corpus
    from fbt_megatron.recipe import load_recipe

    fbt_recipe, task_recipe = load_recipe(str(FBT)), load_recipe(str(TASK_FBT))
    iters = args.train_iters or fbt_recipe.training.train_iters
    task_iters = args.task_iters or task_recipe.training.train_iters
    for name, value in (("--train-iters", iters), ("--task-iters", task_iters), ("--seeds", args.seeds),
                        ("--eval-sequences", args.eval_sequences), ("--jobs", args.jobs), ("--threads", args.threads or 1)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    threads = args.threads or max(1, cores // args.jobs)
    start = time.perf_counter()
    d = fbt_recipe.data
    if not (ROOT / d.data_path / "corpus.json").is_file():
        print(f"preparing the corpus {d.data_path}, once: Python's standard library → a {d.vocab_size}-piece "
              "sentencepiece BPE → .bin/.idx (about half a minute)", flush=True)
    ensure_corpus(d.corpus, str(ROOT / d.data_path), vocab_size=d.vocab_size)
    print(f"corpus ready after {time.perf_counter() - start:.0f} s", flush=True)

    out = ROOT / args.output
    eval_lengths = [1, 2, 4]
    plan = [("baseline", BASELINE, iters), ("FBT", FBT, iters)] + ([("baseline 2x tokens", BASELINE, 2 * iters)] if args.twice_tokens else [])
    runs = [Run(name, name, recipe, n, out / "lm" / f"{name.replace(' ', '_')}-{n}", train_work=training_work(recipe, n))
            for name, recipe, n in plan]
    length = task_recipe.data.seq_length
    for task in args.tasks:
        data = ["--corpus", f"state_tracking:{task}", "--data-path", str(ROOT / "data" / f"state_tracking-{task}-{length}")]
        for seed in range(1, args.seeds + 1):
            for model, recipe in (("baseline", TASK_BASELINE), ("FBT", TASK_FBT)):
                runs.append(Run(f"{task} {model} seed {seed}", model, recipe, task_iters,
                                out / "state_tracking" / task / f"{model}-{task_iters}-seed{seed}",
                                [*data, "--seed", str(seed)], task, training_work(recipe, task_iters),
                                evaluation_work(recipe, args.eval_sequences, eval_lengths[-1] * length)))
    print(f"{len(runs)} runs, {args.jobs} at a time with {threads} thread{'s' if threads > 1 else ''} each; "
          f"logs in each run's train.log", flush=True)
    runner = Runner(runs, args.jobs, threads, args.eval_sequences, eval_lengths)
    runner.run_all()

    lm_runs = [summarize_lm(r) for r in runs if r.task is None]
    passes = fbt_recipe.training.fused_prefill_passes
    minutes = (time.perf_counter() - start) / 60
    sections = [
        "## Language modelling", lm_table(lm_runs, passes),
        f"{iters} steps per model, {fbt_recipe.training.global_batch_size} × {d.seq_length} tokens per step; "
        "validation on held-out files of the corpus.",
        lm_findings(lm_runs, pass_mixture(FBT, iters), fbt_recipe.model_overrides.get("pass_weights")),
    ]
    tasks = {}
    for task in args.tasks:
        tasks[task] = {m: [] for m in ("baseline", "FBT")}
        for r in runs:
            if r.task == task:
                tasks[task][r.model].append(json.loads((r.folder / "eval.json").read_text()))
        sections += [f"## State tracking: {task}", task_table(tasks[task]),
                     f"Accuracy by position bucket, mean over seeds 1–{args.seeds} (min–max); {task_iters} steps per "
                     f"model at length {length}, {task_recipe.training.global_batch_size} sequences per step; "
                     f"{args.eval_sequences} test sequences of length {eval_lengths[-1] * length}.",
                     task_findings(task, tasks[task])]
    reused = f", {runner.reused} of them finished before and reused" if runner.reused else ""
    sections.append(f"{minutes:.1f} min in all on this machine ({len(runs)} runs{reused}; {args.jobs} at a time, "
                    f"{threads} thread{'s' if threads > 1 else ''} each).")
    text = "\n\n".join(sections) + "\n"
    (out / "results.md").write_text("# Demo results\n\n" + text)
    plot(lm_runs, tasks, out / "results.png")
    print("\n" + text)
    print(f"wrote {out / 'results.md'} and {out / 'results.png'}")
    return 0


if __name__ == "__main__":
    run_cli(main)
