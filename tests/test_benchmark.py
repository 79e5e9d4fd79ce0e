"""tools/benchmark.py runs end to end and reports every ratio (the timing goals are not tested)."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATIO_KEYS = {
    "step_time_k2_vs_k1",
    "step_time_k3_vs_k1",
    "throughput_vs_no_feedback",
    "throughput_vs_gpt_model",
    "throughput_vs_gpt_local_spec",
    "activation_memory_k2_vs_k1",
    "activation_memory_k3_vs_k1",
    "activation_memory_k3_vs_k1_recompute",
    "recompute_time_k3",
    "offload_memory_k3",
    "offload_time_k3",
}


def run(*flags):
    return subprocess.run([sys.executable, "tools/benchmark.py", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_quick_run_writes_every_ratio(tmp_path):
    out = tmp_path / "bench.json"
    done = run("--quick", "--json", str(out))
    assert done.returncode == 0, done.stderr
    ratios = json.loads(out.read_text())["ratios"]
    assert set(ratios) == RATIO_KEYS
    for key, r in ratios.items():
        assert math.isfinite(r["value"]) and r["value"] > 0, (key, r)
        assert r["status"] in {"PASS", "MISS", "info"}
        assert r["label"] in done.stdout


def test_bad_flags_are_one_error_line():
    for flags in (["--repeats", "0"], ["--no-such-flag"], ["--preset", "fbt-7b"]):
        done = run(*flags)
        assert done.returncode == 2, (flags, done.stderr)
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, (flags, done.stderr)
