"""tools/demo.py on synthetic results: which settings it keeps (only those that held for every seed in
the shipped studies), the words written from the numbers, and an honest figure."""

import json

import demo
import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb


def lm_row(model, epochs, valid, compute_of=None, k=1):
    tokens = int(epochs * 100_000)
    curve = [{"step": s, "tokens": tokens * s // 4, "compute_tokens": k * tokens * s // 4, "valid": [v + 0.1 * (4 - s) for v in valid]}
             for s in (1, 2, 3, 4)]
    return {"data": "100k", "model": model, "length": f"e{epochs:g}", "seed": 1, "threads": 1, "steps": 100,
            "epochs": epochs, "compute_of": compute_of, "tokens": tokens, "compute_tokens": k * tokens,
            "valid": valid, "best_valid": valid[0], "curve": curve}


def verdict(gaps, below):
    return {"data": "100k", "model": "fbt_k2", "length": "e8", "seeds": len(gaps), "compute_tokens": 1.6e6,
            "fused0_minus_frontier": {"mean": sum(gaps) / len(gaps), "min": min(gaps), "max": max(gaps), "n": len(gaps)},
            "fused0_below_frontier": below}


def test_the_data_constrained_comparison_quotes_whether_it_held_in_every_seed():
    held, not_held = verdict([-0.05, -0.02, -0.03], 3), verdict([-0.05, 0.01, -0.03], 2)
    assert demo.lm_verdict({"per_cell": [held]}, "100k", "fbt_k2", "e8") == held and demo.held(held)
    assert demo.lm_verdict({"per_cell": [not_held]}, "100k", "fbt_k2", "e8") == not_held and not demo.held(not_held)
    assert demo.lm_verdict({"per_cell": [held]}, "100k", "fbt_k2", "e4") is None  # not studied: not run
    assert demo.lm_verdict(None, "100k", "fbt_k2", "e8") is None
    text = demo.lm_left_out([not_held])  # not run: one line with the study's numbers instead
    assert text.startswith("Not shown: in the study behind docs/evidence.md, FBT (fbt_k2, e8) ended below the baseline's best")
    assert "in 2 of 3 seeds on 100k (FBT minus that best: -0.0233 on average, -0.0500 to +0.0100)" in text
    assert "the study's answer is no," in text and "(the numbers: docs/evidence/compute_for_data/)" in text


def test_a_comparison_left_out_says_why():
    assert "no shipped result yet (docs/evidence/state_tracking/)" in demo.not_shown("state_tracking", False, "x")
    held_not = demo.not_shown("compute_for_data", True, "FBT did not end below")
    assert "in the study behind docs/evidence.md, FBT did not end below (the numbers: docs/evidence/compute_for_data/)" in held_not


def test_a_task_setting_is_kept_only_when_every_run_held_at_two_thread_counts():
    from types import SimpleNamespace

    def run(model, length, threads, held=True):
        return {"data": "parity", "model": model, "length": length, "threads": threads, "held": held}

    runs = [run("fbt_window8", "s3000", t) for t in (1, 2)] + [run("fbt_window8", "s1500", 1, False),
                                                             run("fbt", "s1500", 1), run("fbt", "s1500", 2, False),
                                                             run("fbt_k4", "s1500", 1)]
    setting = lambda model, length: SimpleNamespace(data="parity", model=model, length=length)  # noqa: E731
    assert demo.task_held({"runs": runs}, setting("fbt_window8", "s3000"))  # its own length only
    assert not demo.task_held({"runs": runs}, setting("fbt_window8", "s1500"))
    assert not demo.task_held({"runs": runs}, setting("fbt", "s1500"))  # one thread count failed
    assert not demo.task_held({"runs": runs}, setting("fbt_k4", "s1500"))  # held at one thread count only
    assert not demo.task_held({"runs": runs}, setting("fbt_jitter", "s1500"))  # never tried


def test_the_demo_s_task_seed_is_set_beside_the_study_s_runs():
    from types import SimpleNamespace

    runs = [{"data": "parity", "model": "w8", "length": "s3000", "threads": t, "seed": s, "held": True}
            for t, seeds in ((1, range(1, 11)), (2, (1, 2, 4))) for s in seeds]
    runs.append({"data": "parity", "model": "w8", "length": "s1500", "threads": 1, "seed": 1, "held": False})
    text = demo.task_study({"runs": runs}, SimpleNamespace(data="parity", model="w8", length="s3000"))
    assert text == ("In the study behind docs/evidence.md this setting (w8, s3000) held in all 13 of its runs "
                    "(seeds 1–10 at 1 thread and seeds 1, 2, 4 at 2 threads): its full recurrence at least 0.95 "
                    "accurate in every position bucket.")


def test_the_task_baseline_is_the_study_s_runs_trained_as_long(tmp_path, monkeypatch):
    """The demo does not train the state-tracking baseline: it reads the study's runs of the baseline
    at the FBT setting's data and length from their shipped records (runs without a record left out)."""
    from types import SimpleNamespace

    from fbt_megatron.experiments.grid import load_study

    study = load_study(demo.STUDIES / "state_tracking.yaml")
    monkeypatch.setattr(demo, "EVIDENCE", tmp_path)
    runs = [{"data": "parity", "model": m, "length": n, "threads": 1, "seed": s}
            for m, n, s in (("baseline", "s3000", 2), ("baseline", "s3000", 1), ("baseline", "s1500", 1),
                            ("baseline_window8", "s3000", 1), ("baseline", "s3000", 3))]
    for r in runs[:-1]:  # seed 3 was reported before records
        folder = study.run_folder(tmp_path / "state_tracking" / "records", r["data"], r["model"], r["length"], r["seed"], 1)
        folder.mkdir(parents=True)
        (folder / "eval.json").write_text(json.dumps({"source": (r["model"], r["length"], r["seed"])}))
    setting = SimpleNamespace(data="parity", model="fbt_window8_jitter", length="s3000")
    found = demo.study_baselines(study, {"runs": runs}, setting)
    assert found == [{"source": ["baseline", "s3000", s], "seed": s} for s in (1, 2)]
    assert demo.baseline_source(found, setting) == ("The baseline rows are the study's baseline trained as long (s3000; "
                                                    "seeds 1, 2), read from its shipped records, not trained by the demo.")
    assert demo.study_baselines(study, None, setting) == []


def test_compute_for_data_paragraph_quotes_the_runs_and_the_study():
    rows = [lm_row("baseline", 8, [3.81]), lm_row("fbt_k2", 8, [3.7512, 3.78], k=2), lm_row("baseline", 16, [3.9001], "fbt_k2")]
    text = demo.lm_findings(rows, verdict([-0.05, -0.02, -0.03], 3), {"tokens": 100_000, "documents": 22}, [])
    assert "100,000 tokens (22 whole documents" in text
    assert "the baseline's validation loss is 3.8100 and FBT's (k = 2 passes on every step, decoded without fused passes) 3.7512" in text
    assert "the baseline given FBT's compute (16 epochs, 1,600,000 compute tokens) ends at 3.9001" in text
    assert "(3 seeds), FBT ended below the baseline's best final loss at any number of epochs tried in every seed, " \
           "by 0.0333 on average (0.0200 to 0.0500)" in text
    assert "1B parameters trained on 100B tokens" in text


def test_a_subset_that_held_among_others_that_did_not_is_left_out():
    here = verdict([-0.05, -0.02, -0.03], 3)
    elsewhere = [{**verdict([0.02, -0.01, 0.03], 1), "data": "1m"}, {**verdict([-0.01, -0.02, -0.03], 3), "data": "300k"},
                 {**verdict([0.1], 0), "model": "fbt_mix"}, here]  # another model, and this very cell: not counted
    others = demo.other_subsets([{"per_cell": elsewhere[:2]}, {"per_cell": elsewhere[2:]}], here)
    assert [v["data"] for v in others] == ["1m", "300k"]
    text = demo.lm_left_out([here, *others])  # held here and on 300k, not on 1m: not shown
    assert ("in 3 of 3 seeds on 100k (FBT minus that best: -0.0333 on average, -0.0500 to -0.0200); 1 of 3 seeds on 1m "
            "(FBT minus that best: +0.0133 on average, -0.0100 to +0.0300); 3 of 3 seeds on 300k") in text
    assert "the study's answer is no on 1 of the 3 subsets it tried" in text
    rows = [lm_row("baseline", 8, [3.81]), lm_row("fbt_k2", 8, [3.7512], k=2)]  # held on every subset: shown
    text = demo.lm_findings(rows, here, {"tokens": 100_000, "documents": 22}, others[1:])
    assert "It held in every seed on the study's other subsets too (300k)." in text


def task_result(values: dict, train_length=4):
    """An evaluation result with the same accuracy at every position of a bucket."""
    accuracy = {mode: dict(zip(("1x", "2x", "4x"), v)) for mode, v in values.items()}
    widths = (train_length, train_length, 2 * train_length)
    by_position = {mode: [a for a, w in zip(v, widths) for _ in range(w)] for mode, v in values.items()}
    return {"task": "parity", "chance": 0.5, "train_length": train_length, "test_length": 4 * train_length,
            "sequences": 8, "accuracy": accuracy, "by_position": by_position}


def task_results(fbt_full, baseline=(0.85, 0.51, 0.49)):
    fused = {f"{j} fused": (0.7 + 0.05 * j, 0.5, 0.5) for j in range(4)}
    return {
        "baseline": [task_result({"0 fused": baseline})] * 2,
        "FBT": [task_result({**fused, "full recurrence": full}) for full in fbt_full],
    }


def test_state_tracking_table_and_paragraph_follow_the_numbers():
    won = task_results([(1.0, 1.0, 1.0), (1.0, 1.0, 1.0)])
    table = demo.task_table(won)
    assert "| positions 1–4 (1x) | 5–8 (2x) | 9–16 (4x) |" in table
    assert "| FBT, full recurrence | 1.000 (1.00–1.00) | 1.000 (1.00–1.00) | 1.000 (1.00–1.00) |" in table
    text = demo.task_findings("parity", won)
    assert text.startswith("**parity, trained at length 4, tested to length 16 (chance 0.50); FBT: 2 seeds, the baseline: 2 seeds.**")
    assert "the baseline is at chance, 0.510" in text and "right at every position in every seed" in text
    assert "in 2 of 2 seeds, FBT after 3 fused passes in 0, the baseline in 0" in text and "not enough" in text
    assert "(positions 4–4) the baseline is 0.850 (0.85–0.85), FBT after 3 fused passes 0.850 (0.85–0.85) and " \
           "with the full recurrence right at every position" in text
    lost = demo.task_findings("parity", task_results([(0.9, 0.5, 0.5), (0.8, 0.52, 0.49)]))
    assert "in 0 of 2 seeds" in lost and "no win here" in lost


def test_figure_is_honest():
    rows = [lm_row("baseline", 8, [3.81]), lm_row("fbt_k2", 8, [3.75, 3.78], k=2), lm_row("baseline", 16, [3.9], "fbt_k2")]
    fig = demo.plot(rows, 3.79, {"parity": task_results([(1.0, 0.98, 0.95), (1.0, 1.0, 0.97)])}, "/dev/null")
    lm, accuracy = fig.axes
    assert "lower is better" in lm.get_ylabel() and "higher is better" in accuracy.get_ylabel()
    assert lm.get_xlabel().startswith("compute tokens")  # the comparison is at equal compute
    rgb = lambda c: tuple(round(x, 6) for x in to_rgb(c))  # noqa: E731
    lines = {line.get_label(): rgb(line.get_color()) for ax in (lm, accuracy) for line in ax.get_lines()}
    assert lines["baseline, 8 epochs"] == lines["baseline"]  # the same colour for the baseline on every panel
    assert len({lines["baseline, 8 epochs"], lines["baseline, 16 epochs (FBT's compute)"], lines["FBT k = 2, 8 epochs"],
                lines["FBT, full recurrence"]}) == 4
    assert "baseline's best at any epochs (study, mean of seeds)" in lines
    plt.close(fig)
    only_tasks = demo.plot([], None, {"parity": task_results([(1.0, 1.0, 1.0)])}, "/dev/null")
    assert len(only_tasks.axes) == 1  # no compute-for-data panel when it did not hold
    plt.close(only_tasks)


def test_tokenizer_training_names_its_silent_stage_on_a_terminal(tmp_path, monkeypatch):
    """Corpus preparation shows every stage on a terminal, the sentencepiece merges included."""
    import io
    import os
    import sys
    import sysconfig

    from fbt_megatron.data.tokenizer_training import train_tokenizer

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    source = os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py")
    train_tokenizer([source], str(tmp_path / "t.model"), 400)
    shown = sys.stderr.getvalue()
    assert "tokenizer: learning 400 BPE pieces from" in shown and shown.rstrip().endswith(tuple("0123456789"))


def test_with_no_comparison_held_the_one_fbt_run_is_plotted_alone():
    fig = demo.plot([lm_row("fbt_k2", 8, [3.75, 3.78], k=2)], None, {}, "/dev/null")
    [ax] = fig.axes
    assert "no comparison" in ax.get_title()
    assert {line.get_label() for line in ax.get_lines()} == {"FBT k = 2, 8 epochs, 0 fused", "FBT k = 2, 8 epochs, 1 fused"}
    plt.close(fig)
    text = demo.run_findings(lm_row("fbt_k2", 8, [3.7512, 3.7801], k=2), {"tokens": 100_000, "documents": 22})
    assert "No comparison of docs/evidence.md held in every seed" in text and "not a result" in text
    assert "validation loss 3.7512 after 0 fused prefill passes and 3.7801 after 1 fused prefill pass" in text


def test_the_full_option_reruns_every_shipped_report_with_its_grids():
    shipped = sorted(p.parent.name for p in demo.EVIDENCE.glob("*/results.json"))
    assert sorted(folder for _, folder, _ in demo.FULL_REPORTS) == shipped
    for _, folder, grids in demo.FULL_REPORTS:
        assert list(json.loads((demo.EVIDENCE / folder / "results.json").read_text())["wall_by_grid"]) == grids
