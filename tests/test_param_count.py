import subprocess
import sys
from pathlib import Path

from count_params import count

ROOT = Path(__file__).resolve().parents[1]


def backbone_formula(L, D, F, V, heads, kv_heads, head_dim):
    attention = D * (heads + 2 * kv_heads) * head_dim + heads * head_dim * D + D * heads + 2 * head_dim
    norms = 4 * D  # input, post-attention, pre-FF, post-FF
    mlp = 3 * D * F
    return V * D + L * (attention + norms + mlp) + D  # tied embedding, final norm


def test_fbt_1b_count_on_meta_device():
    c = count("fbt-1b")
    D = 1536
    assert c["backbone"] == backbone_formula(24, D, 6656, 100352, 16, 8, 96) == 1_060_853_760
    assert c["fusion"] == 2 * D * D + D
    assert c["total"] == 1_065_573_888


def test_tool_prints_the_count_and_rejects_unknown_presets():
    run = lambda *a: subprocess.run([sys.executable, "tools/count_params.py", *a], cwd=ROOT, capture_output=True, text=True)
    ok = run("--preset", "fbt-1b")
    assert ok.returncode == 0, ok.stderr
    assert "fbt-1b: 1,065,573,888 parameters" in ok.stdout
    bad = run("--preset", "fbt-7b")
    assert bad.returncode == 2 and "unknown model preset 'fbt-7b'" in bad.stderr
