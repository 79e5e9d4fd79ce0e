"""The CPU main job: what latent feedback does at micro scale, set against the studies' verdicts.

Two comparisons of a baseline and FBT, each the small ``demo`` grid of a study behind
``docs/evidence.md`` (the shipped results in ``docs/evidence/<study>/``):

  * compute for data (``recipes/studies/compute_for_data.yaml``): on a fixed corpus (whole documents
    of the stdlib training split; the ``demo`` grid says which subset and epochs), the baseline
    against FBT with k = 2 passes on every step at the same epochs; validation loss against compute
    tokens, beside the baseline's best at any number of epochs from the study; one seed, run only
    when the study found it in every seed on every subset it tried (otherwise one line gives the
    study's numbers: a subset that held among others that did not would be a best case);
  * state tracking (``recipes/studies/state_tracking.yaml``): running parity trained at length 32,
    accuracy by position up to 4× that, of the baseline and of FBT's full recurrence; one seed of
    an FBT setting, run only when it held in every seed and thread count of the study (the paragraph
    quotes those runs), beside the study's baseline runs trained as long (their shipped records:
    the baseline is not trained again, for the demo's time).

When no comparison held in every seed, the demo trains the FBT run of the compute-for-data ``demo``
grid alone and shows its validation losses and one prompt decoded in each mode (standard, soft,
fused(1)): the method at work, no comparison.

Runs go through the training entry point 2 at a time, 1 thread each (``fbt_megatron.studies``);
finished runs are reused, interrupted ones resume. Results: ``<output>/results.md`` (tables, and a
paragraph per comparison written from the numbers) and ``<output>/results.png``.

    python tools/demo.py                  # the comparisons that held in every seed of the studies
    python tools/demo.py --full           # the studies' grids behind docs/evidence.md (hours)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional

from fbt_megatron.common.cli import plural, quiet_library_warnings, run_cli
from fbt_megatron.common.logs import setup_logging
from fbt_megatron.experiments.results import HELD
from fbt_megatron.evaluation.tasks.evaluate import FULL, bucket_labels

ROOT = Path(__file__).resolve().parent.parent
STUDIES = ROOT / "recipes" / "studies"
EVIDENCE = ROOT / "docs" / "evidence"
LM, TASK = "compute_for_data", "state_tracking"
FULL_REPORTS = [  # what docs/evidence.md reports: (study, its report's folder under docs/evidence/, grids)
    (LM, LM, ["cut", "cut_mix", "cut_e4", "wide", "wide_e8", "cut_300k", "cut_300k_e12", "cut_300k_frontier", "cut_300k_mix"]),
    (LM, f"{LM}_1m", ["cut_1m"]),
    (LM, f"{LM}_300k_cap", ["cut_300k_cap"]),
    (TASK, TASK, ["screen", "baselines", "more", "more2", "threads2_recipe", "more3", "more4", "more5", "more6",
                  "threads2_jitter", "more7", "baselines_s3000"]),
]
PAPER = "1B parameters trained on 100B tokens"


# ---------------------------------------------------------------- which settings held in the studies
def shipped(study: str, name: str) -> Optional[dict]:
    path = EVIDENCE / study / name
    return json.loads(path.read_text()) if path.is_file() else None


def every_report(study: str, name: str) -> List[dict]:
    """``name`` of every shipped report of ``study`` (``docs/evidence/<study>*/``: a grid may be reported on its own)."""
    return [json.loads(p.read_text()) for p in sorted(EVIDENCE.glob(f"{study}*/{name}"))]


def other_subsets(summaries: List[dict], verdict: dict) -> List[dict]:
    """The study's verdicts on the same FBT run on its other subsets."""
    return [v for s in summaries for v in s["per_cell"]
            if (v["model"], v["length"]) == (verdict["model"], verdict["length"]) and v["data"] != verdict["data"]]


def lm_verdict(summary: Optional[dict], data: str, model: str, length: str) -> Optional[dict]:
    """The study's verdict on this FBT cell (its seeds, and in how many its standard pass (0 fused)
    ended below the baseline's best final validation loss); None when the study has not run it."""
    return next((v for v in (summary or {}).get("per_cell", []) if (v["data"], v["model"], v["length"]) == (data, model, length)),
                None)


def is_baseline(run) -> bool:
    return run.model.startswith("baseline")


def held(verdict: Optional[dict]) -> bool:
    """Whether the study's result held in every seed."""
    return verdict is not None and verdict["fused0_below_frontier"] == verdict["seeds"]


def not_shown(study: str, studied: bool, why: str) -> str:
    """The line a comparison gets when the demo leaves it out: the study's verdict, or that it has none yet."""
    if studied:
        return f"Not shown: in the study behind docs/evidence.md, {why} (the numbers: docs/evidence/{study}/)."
    return (f"Not shown: the study behind docs/evidence.md has no shipped result yet (docs/evidence/{study}/); "
            "the demo shows a comparison only once it held in every seed there.")


def task_held(results: Optional[dict], run) -> bool:
    """Whether the study ran ``run``'s setting (its data, model and length) at two thread counts or
    more and every run of it held: its full recurrence ≥ 0.95 at every position bucket."""
    runs = [r for r in (results or {}).get("runs", []) if (r["data"], r["model"], r["length"]) == (run.data, run.model, run.length)]
    return len({r["threads"] for r in runs}) >= 2 and all(r["held"] for r in runs)


def seed_list(seeds: List[int]) -> str:
    """1–5, or 1, 3, 7 when not a run of consecutive seeds."""
    seeds = sorted(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}–{seeds[-1]}"
    return ", ".join(map(str, seeds))


def study_baselines(study, results: Optional[dict], run) -> List[dict]:
    """The evaluations of the study's baseline runs trained as long as ``run`` on its data, by seed,
    from their shipped records (``docs/evidence/<study>/records``; runs reported before records are left out)."""
    records = EVIDENCE / study.name / "records"
    runs = sorted((r for r in (results or {}).get("runs", [])
                   if r["model"] == "baseline" and (r["data"], r["length"]) == (run.data, run.length)),
                  key=lambda r: (r["threads"], r["seed"]))
    files = [(r["seed"], study.run_folder(records, r["data"], r["model"], r["length"], r["seed"], r["threads"]) / "eval.json")
             for r in runs]
    return [{**json.loads(f.read_text()), "seed": seed} for seed, f in files if f.is_file()]


def task_study(results: dict, run) -> str:
    """The study's runs of ``run``'s setting, in words (shown beside the demo's own seed)."""
    runs = [r for r in results["runs"] if (r["data"], r["model"], r["length"]) == (run.data, run.model, run.length)]
    by_threads: Dict[int, List[int]] = {}
    for r in runs:
        by_threads.setdefault(r["threads"], []).append(r["seed"])
    where = " and ".join(f"seeds {seed_list(seeds)} at {plural(t, 'thread')}" for t, seeds in sorted(by_threads.items()))
    return (f"In the study behind docs/evidence.md this setting ({run.model}, {run.length}) held in all "
            f"{len(runs)} of its runs ({where}): its full recurrence at least {HELD} accurate in every position bucket.")


def baseline_source(baselines: List[dict], run) -> str:
    """Where the demo's baseline rows come from: the study's runs, not trained here."""
    return (f"The baseline rows are the study's baseline trained as long ({run.length}; seeds "
            f"{seed_list([b['seed'] for b in baselines])}), read from its shipped records, not trained by the demo.")


def lm_left_out(verdicts: List[dict]) -> str:
    """Why the demo does not run the compute-for-data comparison: on some subset the study tried (the
    demo's own first), not every seed of the same FBT run ended below the baseline's best."""
    first = verdicts[0]
    seeds = "; ".join(
        f"{v['fused0_below_frontier']} of {v['seeds']} seeds on {v['data']} (FBT minus that best: "
        f"{v['fused0_minus_frontier']['mean']:+.4f} on average, {v['fused0_minus_frontier']['min']:+.4f} to "
        f"{v['fused0_minus_frontier']['max']:+.4f})" for v in verdicts)
    no = sum(not held(v) for v in verdicts)
    answer = "is no" if len(verdicts) == 1 else f"is no on {no} of the {len(verdicts)} subsets it tried"
    return not_shown(LM, True, (
        f"FBT ({first['model']}, {first['length']}) ended below the baseline's best final validation loss at any "
        f"number of epochs tried in {seeds}: the study's answer {answer}, and one seed of one subset would show a "
        "single trajectory, not a result"))


def lm_findings(rows: List[dict], verdict: dict, subset: dict, others: List[dict]) -> str:
    """One paragraph on the compute-for-data comparison (shown only when it held in every seed of the
    study on every subset it tried): this demo's runs, then the study's seeds and its other subsets."""
    fbt = next(r for r in rows if not r["model"].startswith("baseline"))
    same = next(r for r in rows if r["model"].startswith("baseline") and r["compute_of"] is None)
    equal = next((r for r in rows if r["compute_of"] == fbt["model"]), None)
    gap = verdict["fused0_minus_frontier"]
    text = (f"**Compute for data.** On a fixed corpus of {subset['tokens']:,} tokens ({subset['documents']} whole "
            f"documents of the stdlib training split), after {fbt['epochs']:g} epochs the baseline's validation loss is "
            f"{same['valid'][0]:.4f} and FBT's (k = 2 passes on every step, decoded without fused passes) "
            f"{fbt['valid'][0]:.4f}")
    if equal is not None:
        text += (f"; the baseline given FBT's compute ({equal['epochs']:g} epochs, {equal['compute_tokens']:,} compute "
                 f"tokens) ends at {equal['valid'][0]:.4f}")
    text += (f". In the study behind docs/evidence.md ({verdict['seeds']} seeds), FBT ended below the baseline's best "
             f"final loss at any number of epochs tried in every seed, by {-gap['mean']:.4f} on average "
             f"({-gap['max']:.4f} to {-gap['min']:.4f}).")
    if others:
        text += f" It held in every seed on the study's other subsets too ({', '.join(v['data'] for v in others)})."
    text += (f" This is a micro-scale run of the paper's trade (compute spent as passes on a fixed corpus); the "
             f"paper's claims are for {PAPER}.")
    return text


PROMPT = 'def read_config(path):\n    """'
SAMPLE_MODES = [("standard", 0), ("soft", 0), ("fused", 1)]


def samples(folder: Path, new_tokens: int = 48) -> str:
    """The run's greedy continuation of PROMPT in each decoding mode, as a markdown block."""
    from fbt_megatron.inference.generate import generate
    from fbt_megatron.inference.runs import load_run

    run = load_run(str(folder))
    prompt = run.tokenizer.tokenize(PROMPT)
    blocks = []
    for mode, passes in SAMPLE_MODES:
        out = generate(run.model, [prompt], mode=mode, fused_passes=passes, max_new_tokens=new_tokens,
                       vocab_size=run.tokenizer.vocab_size).tokens[0]
        name = f"fused({passes})" if mode == "fused" else mode
        blocks.append(f"{name}:\n\n```python\n{run.tokenizer.detokenize(prompt + out)}\n```")
    return "\n\n".join(blocks)


def run_findings(row: dict, subset: dict) -> str:
    """The paragraph of the demo's one FBT run, shown when no comparison held in every seed."""
    valid = " and ".join(f"{v:.4f} after {j} fused prefill pass{'es' if j != 1 else ''}" for j, v in enumerate(row["valid"]))
    return (f"**One FBT run, no comparison.** No comparison of docs/evidence.md held in every seed of its study, so "
            f"the demo trains one FBT model (k = 2 passes on every step) through the training entry point on "
            f"{subset['tokens']:,} tokens ({subset['documents']} whole documents of the stdlib training split) for "
            f"{row['epochs']:g} epochs ({row['steps']:,} steps, {row['compute_tokens']:,} compute tokens): validation loss "
            f"{valid}. It shows the method at work, not a result. The same prompt, decoded greedily in each mode "
            f"(standard: tokens only; soft: each generated token fused with the previous position's state; fused(1): one "
            f"more fused pass over the prompt first):")


# ---------------------------------------------------------------- state tracking: numbers and words
def spread(values: List[float]) -> str:
    """mean (min–max) over seeds."""
    return f"{statistics.mean(values):.3f}" + (f" ({min(values):.2f}–{max(values):.2f})" if len(values) > 1 else "")


def task_modes(results: Dict[str, List[dict]]) -> List[tuple]:
    """(row label, model, eval mode) for every row of a task's table, baseline first."""
    rows = [("baseline", "baseline", mode) for mode in results["baseline"][0]["accuracy"]]
    rows += [(f"FBT, {mode}", "FBT", mode) for mode in results["FBT"][0]["accuracy"]]
    return rows


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
    text = (f"**{task}, trained at length {t}, tested to length {first['test_length']} (chance {chance:.2f}); FBT: "
            f"{plural(seeds, 'seed')}, the baseline: {plural(len(results['baseline']), 'seed')}.** Within the training "
            f"length the baseline is at "
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
             f"{seeds} seeds, FBT after {most} passes in {few}, the baseline in {baseline} of {len(results['baseline'])}. ")
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
    """One colour per model and mode on every panel: the baseline blue (lighter: at FBT's compute),
    FBT orange (darker with more fused passes), FBT's full recurrence red."""
    import matplotlib

    if model.startswith("baseline"):
        return "tab:cyan" if "compute" in model else "tab:blue"
    if mode == FULL:
        return "tab:red"
    fused = int(mode.split()[0]) if mode else 0
    return matplotlib.colormaps["Oranges"](0.45 + 0.15 * fused)


def lm_label(row: dict) -> str:
    if row["model"].startswith("baseline"):
        return f"baseline, {row['epochs']:g} epochs" + (" (FBT's compute)" if row["compute_of"] else "")
    return f"FBT k = 2, {row['epochs']:g} epochs"


def plot(lm_rows: List[dict], frontier: Optional[float], tasks: Dict[str, Dict[str, List[dict]]], path):
    """The compute-for-data panel (validation loss against compute tokens) when shown, and one panel
    per state-tracking task (accuracy by position); written to ``path``, returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (1 if lm_rows else 0) + len(tasks)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(6.5 * max(panels, 1), 4.8), squeeze=False)
    axes = list(axes[0])
    if lm_rows:
        ax = axes.pop(0)
        compared = any(row["model"].startswith("baseline") for row in lm_rows)
        for row in lm_rows:
            name = "baseline at FBT's compute" if row["compute_of"] else row["model"]
            curve = row["curve"]
            for j in range(1 if compared else len(row["valid"])):  # alone: after each number of fused passes
                ax.plot([p["compute_tokens"] for p in curve], [p["valid"][j] for p in curve], "o-",
                        color=color(name, f"{j} fused"), label=lm_label(row) + (f", {j} fused" if not compared else ""))
        if frontier is not None:
            ax.axhline(frontier, color="tab:blue", ls=":", lw=1, label="baseline's best at any epochs (study, mean of seeds)")
        ax.set_xscale("log")
        ax.set(xlabel="compute tokens (tokens × passes)", ylabel="validation loss (lower is better)",
               title="compute for data: a fixed corpus, more epochs or more passes" if compared
               else "one FBT run on a fixed corpus (no comparison)")
        ax.legend(fontsize=7)
    for ax, (task, results) in zip(axes, tasks.items()):
        first = results["FBT"][0]
        positions = range(1, first["test_length"] + 1)
        for label, model, mode in task_modes(results):
            if model == "FBT" and mode != FULL and mode != "0 fused":
                continue  # the plain pass and the full recurrence; the table has the rest
            per_seed = [r["by_position"][mode] for r in results[model]]
            ax.plot(positions, [statistics.mean(v) for v in zip(*per_seed)], color=color(model, mode), label=label,
                    lw=1.6 if mode == FULL else 1.0)
            if len(per_seed) > 1:
                ax.fill_between(positions, [min(v) for v in zip(*per_seed)], [max(v) for v in zip(*per_seed)],
                                color=color(model, mode), alpha=0.15, lw=0)
        ax.axvline(first["train_length"] + 0.5, color="gray", ls=":")
        ax.text(first["train_length"], 0.03, " training length", color="gray", fontsize=8)
        ax.axhline(first["chance"], color="gray", lw=0.8, ls="--")
        ax.set_ylim(0, 1.03)
        seeds = {model: plural(len(runs), "seed") for model, runs in results.items()}
        ax.set(xlabel="position", ylabel="accuracy (higher is better)",
               title=f"state tracking, {task}\nFBT: {seeds['FBT']}; baseline: {seeds['baseline']} (mean; band: min–max)")
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    setup_logging()
    from fbt_megatron.experiments import results as study_results
    from fbt_megatron.experiments import study as studies
    from fbt_megatron.experiments.grid import load_study

    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="run the studies' grids behind docs/evidence.md (hours)")
    parser.add_argument("--output", default="runs/demo", help="folder for the runs and results")
    parser.add_argument("--jobs", type=int, default=min(2, cores), help="runs at a time (default: one per core, at most 2)")
    parser.add_argument("--nice", type=int, default=0, help="niceness of the runs (default: 0)")
    args = parser.parse_args(argv)
    quiet_library_warnings()
    out = (ROOT / args.output).resolve()
    start = time.time()
    lm, task = load_study(STUDIES / f"{LM}.yaml"), load_study(STUDIES / f"{TASK}.yaml")
    if args.full:
        reports = [({LM: lm, TASK: task}[name], folder, grids) for name, folder, grids in FULL_REPORTS]
        pairs = [(study, g) for study, _, grids in reports for g in grids]
        failed = studies.run(studies.runs_of_grids(pairs, out, show=True), args.jobs, args.jobs, args.nice).failed
        for study, folder, grids in reports:
            studies.report(study, grids, out, out / folder, partial=bool(failed))
            print(f"wrote {out / folder}: compare with docs/evidence/{folder}/")
        return 1 if failed else 0

    summary, task_results = shipped(LM, "summary.json"), shipped(TASK, "results.json")
    demo_fbt = [(c["data"][0], m, f"e{e:g}") for c in lm.grid("demo")["cells"] for m in c["models"]
                if not m.startswith("baseline") for e in c["epochs"]]
    verdict = lm_verdict(summary, *demo_fbt[0]) if demo_fbt else None
    verdicts = [verdict, *other_subsets(every_report(LM, "summary.json"), verdict)] if verdict else []
    lm_shown = bool(verdicts) and all(held(v) for v in verdicts)
    task_runs = [r for r in studies.runs_of_grids([(task, "demo")], out)  # settings that held, with baselines to compare
                 if task_held(task_results, r) and study_baselines(task, task_results, r)]
    alone = not lm_shown and not task_runs and verdict is not None  # nothing held: one FBT run of the study
    lm_runs = studies.runs_of_grids([(lm, "demo")], out, show=True) if lm_shown or alone else []
    runs = [r for r in lm_runs if not (alone and is_baseline(r))] + task_runs
    print(f"{plural(len(runs), 'run')}, {args.jobs} at a time with 1 thread each; logs in each run's train.log", flush=True)
    failed = studies.run(runs, args.jobs, args.jobs, args.nice).failed
    if failed:
        raise RuntimeError(f"{len(failed)} runs failed: " + "; ".join(f"{r.label}: {m}" for r, m in failed))

    sections, lm_rows, frontier, tasks = [], [], None, {}
    if lm_shown:
        lm_rows = [study_results.run_result(r) for r in runs if r.study == LM]
        subset = json.loads((lm.subset_folder(out, lm_rows[0]["data"]) / "corpus.json").read_text())["splits"]["train"]
        base = [c for c in shipped(LM, "results.json")["cells"] if c["data"] == lm_rows[0]["data"] and c["model"] == "baseline"]
        frontier = min(c["valid"][0]["mean"] for c in base)
        sections += ["## Compute for data", study_results.lm_table(study_results.cell_results(lm_rows)),
                     lm_findings(lm_rows, verdict, subset, verdicts[1:])]
    else:
        sections += ["## Compute for data", lm_left_out(verdicts) if verdicts else not_shown(LM, False, "")]
    if alone:
        lm_rows = [study_results.run_result(r) for r in runs if r.study == LM]
        subset = json.loads((lm.subset_folder(out, lm_rows[0]["data"]) / "corpus.json").read_text())["splits"]["train"]
        folder = next(r.folder for r in runs if r.study == LM)
        sections += ["## One FBT run", study_results.lm_table(study_results.cell_results(lm_rows)),
                     run_findings(lm_rows[0], subset), samples(folder)]
    for r in task_runs:
        result = tasks.setdefault(r.data, {"baseline": study_baselines(task, task_results, r), "FBT": []})
        result["FBT"].append(json.loads((r.folder / "eval.json").read_text()))
    for name, result in tasks.items():
        setting = next(r for r in task_runs if r.data == name)
        words = [task_findings(name, result), task_study(task_results, setting), baseline_source(result["baseline"], setting)]
        sections += [f"## State tracking: {name}", task_table(result), " ".join(words)]
    if not tasks:
        sections += ["## State tracking", not_shown(TASK, task_results is not None,
                                                    "no FBT setting held in every seed and thread count tried "
                                                    "beside a baseline trained as long")]
    minutes = (time.time() - start) / 60
    sections.append(f"{minutes:.1f} min in all on this machine ({plural(len(runs), 'run')}; {args.jobs} at a time, 1 thread each).")
    text = "\n\n".join(sections) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("# Demo results\n\n" + text)
    plot(lm_rows, frontier, tasks, out / "results.png")
    print("\n" + text)
    print(f"wrote {out / 'results.md'} and {out / 'results.png'}")
    return 0


if __name__ == "__main__":
    run_cli(main)
