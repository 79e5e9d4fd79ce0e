"""tools/benchmark.py runs end to end and reports every ratio (the timing goals are not tested),
for the training step and, with --decode, for generation."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

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

DECODE_KEYS = {
    "decode_time_soft_vs_standard",
    "prefill_time_fused1_vs_standard",
    "prefill_time_fused2_vs_standard",
    "prefill_time_fused3_vs_standard",
    "hf_decode_speed_vs_llama",
    "hf_decode_time_vs_megatron",
}

DATA_KEYS = {
    "preprocess_per_core_vs_raw_sentencepiece",
    "preprocess_per_core_vs_raw_huggingface",
    "preprocess_cpu_vs_raw_sentencepiece",
    "preprocess_cpu_vs_raw_huggingface",
    "preprocess_peak_memory_10x",
}


def run(*flags):
    return subprocess.run([sys.executable, "tools/benchmark.py", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("suite, keys", [([], RATIO_KEYS), (["--decode"], DECODE_KEYS), (["--data"], DATA_KEYS)],
                         ids=["training", "decode", "data"])
def test_quick_run_writes_every_ratio(tmp_path, suite, keys):
    out = tmp_path / "bench.json"
    done = run("--quick", *suite, "--json", str(out))
    assert done.returncode == 0, done.stderr
    ratios = json.loads(out.read_text())["ratios"]
    assert set(ratios) == keys
    for key, r in ratios.items():
        assert math.isfinite(r["value"]) and r["value"] > 0, (key, r)
        assert r["status"] in {"PASS", "MISS", "info"}
        assert r["label"] in done.stdout


def test_bad_flags_are_one_error_line():
    for flags in (["--repeats", "0"], ["--no-such-flag"], ["--preset", "fbt-7b"], ["--decode", "--new-tokens", "1"]):
        done = run(*flags)
        assert done.returncode == 2, (flags, done.stderr)
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, (flags, done.stderr)


def test_serving_needs_vllm():
    """--serving (tools/benchmarks/serving.py) runs where vLLM is installed (make serve-setup); here it is one line."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: --serving would run the benchmark (docs/serving.md)")
    done = run("--serving")
    assert done.returncode == 2 and done.stderr.startswith("error: --serving needs vLLM"), done.stderr
    assert done.stderr.count("\n") == 1 and "pip install -r requirements-serve.txt" in done.stderr
