"""tools/demo.py on synthetic records: progress parsed from the real log format, the words written
from the numbers, and an honest figure."""

import demo
import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb

from fbt_megatron.metrics import format_record


def record(step, loss, **extra):
    return {"step": step, "k": 2, "loss": loss, "pass_losses": [loss, loss + 0.1], "state_deltas": [0.5], "lr": 1e-3,
            "grad_norm": 0.4, "tokens_per_s": 12345.6, "tokens": step * 100, "compute_tokens": step * 150, **extra}


def lm_run(name, valid, gaps=(0.6, 0.3)):
    """A summarized run whose validations at steps 100, 200 have these gaps between 1 fused pass and none."""
    evals = [{f"valid_loss_fused{j}": valid[0] + j * gap for j in range(len(valid))} for gap in gaps]
    records = [record(100 * (i + 1), 4.0 - i, **e) for i, e in enumerate(evals)]
    return {"name": name, "records": records, "valid": valid, "tokens": records[-1]["tokens"],
            "compute_tokens": records[-1]["compute_tokens"], "tokens_per_s": 1000.0}


def test_progress_is_parsed_from_the_training_log_line():
    line = format_record(record(1500, 0.3217, valid_loss_fused0=0.3))
    assert demo.parse_step(line) == {"step": 1500, "loss": 0.3217, "tokens_per_s": 12346}
    assert demo.parse_step("fbt-megatron: tiny, 108,224 parameters") is None


def test_fused_passes_share_of_the_loss():
    assert abs(demo.fused_loss_share({1: 0.75, 2: 0.22, 3: 0.03}) - (0.22 / 2 + 0.03 * 2 / 3)) < 1e-12
    assert demo.fused_loss_share({1: 1.0}) == 0.0
    assert abs(demo.fused_loss_share({3: 1.0}, pass_weights=(0.5, 0.25, 0.25)) - 0.5) < 1e-12


def test_language_model_paragraph_states_direction_size_and_why():
    runs = [lm_run("baseline", [3.58]), lm_run("FBT", [3.63, 3.97, 4.05, 4.08])]
    text = demo.lm_findings(runs, {1: 0.75, 2: 0.22, 3: 0.03})
    assert "3.630, 0.050 worse than the baseline's 3.580" in text
    assert "rises to 3.970, 4.050, 4.080" in text
    assert "13% of the training loss" in text
    assert "from +0.600 at step 100 to +0.300 at step 200, shrinking with training" in text
    assert "1B parameters trained on 100B tokens" in text
    better = demo.lm_findings([lm_run("baseline", [3.7]), lm_run("FBT", [3.6, 3.5])], {1: 0.5, 2: 0.5})
    assert "0.100 better than the baseline's" in better and "falls to 3.500" in better


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
    assert "the baseline is at chance, 0.510" in text and "right at every position in every seed" in text
    assert "in 2 of 2 seeds, FBT after 3 fused passes in 0, the baseline in 0" in text and "not enough" in text
    assert "(positions 4–4) the baseline is 0.850 (0.85–0.85), FBT after 3 fused passes 0.850 (0.85–0.85) and " \
           "with the full recurrence right at every position" in text
    lost = demo.task_findings("parity", task_results([(0.9, 0.5, 0.5), (0.8, 0.52, 0.49)]))
    assert "in 0 of 2 seeds" in lost and "no win here" in lost


def test_figure_is_honest():
    runs = [lm_run("baseline", [3.58]), lm_run("FBT", [3.63, 3.97, 4.05, 4.08])]
    fig = demo.plot(runs, {"parity": task_results([(1.0, 0.98, 0.95), (1.0, 1.0, 0.97)])}, "/dev/null")
    curves, bars, accuracy = fig.axes
    assert bars.get_ylim()[0] == 0  # bar heights compare
    assert "lower is better" in curves.get_ylabel() and "lower is better" in bars.get_ylabel()
    assert "higher is better" in accuracy.get_ylabel()
    rgb = lambda c: tuple(round(x, 6) for x in to_rgb(c))  # noqa: E731
    lines = {line.get_label(): rgb(line.get_color()) for ax in (curves, accuracy) for line in ax.get_lines()}
    bar_colours = {t.get_text(): rgb(p.get_facecolor()) for t, p in zip(bars.get_xticklabels(), bars.patches)}
    # the same colour for a model (and number of fused passes) on every panel
    assert lines["baseline (train, standard pass)"] == lines["baseline (valid)"] == lines["baseline"] == bar_colours["baseline"]
    assert lines["FBT (valid, 0 fused)"] == lines["FBT, 0 fused"] == bar_colours["FBT\n0 fused"]
    assert lines["FBT (valid, 3 fused)"] == lines["FBT, 3 fused"] == bar_colours["FBT\n3 fused"]
    assert len({lines["baseline"], lines["FBT, 0 fused"], lines["FBT, 3 fused"], lines["FBT, full recurrence"]}) == 4
    plt.close(fig)


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
