"""The export loads on every transformers version the requirements allow (issue 20, item 6).

requirements.txt allows transformers>=5.16.1 (the tested lower bound); requirements-serve.txt
narrows it to vLLM 0.32's <5.20, on which CI runs the whole suite. Here a real export (``to-hf`` of
the tiny run) is loaded by its own remote code under the lowest allowed version (5.16.1) and the
newest tested (5.24.0), each in a subprocess whose ``transformers`` comes first on the path from
``$FBT_TRANSFORMERS_TARGETS/<version>`` (``pip install --no-deps --target``, as .ci/run makes
them): the k-pass logits equal megatron's, cached generation equals uncached in every decode
mode, and the tokenizer loads. Without those folders the tests skip (CI sets
FBT_REQUIRE_TRANSFORMERS_VERSIONS=1, which makes that a failure). The model card names no
absolute local path.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

LOWEST, NEWEST = "5.16.1", "5.24.0"
TARGETS = "FBT_TRANSFORMERS_TARGETS"

CHECK = r"""
import sys, torch, transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
export, expected_file, version = sys.argv[1:4]
assert transformers.__version__ == version, (transformers.__version__, version)
expected = load_file(expected_file)
x = expected.pop("tokens")
model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).eval()
worst = 0.0
with torch.no_grad():
    for k in (1, 2, 3):
        diff = (model(x, num_passes=k, use_cache=False).logits - expected[f"pass{k}"]).abs().max().item()
        assert diff < 1e-5, (k, diff)
        worst = max(worst, diff)
for mode, n in (("standard", 0), ("soft", 0), ("fused", 2)):
    kwargs = dict(max_new_tokens=6, do_sample=False, decode_mode=mode, fused_prefill_passes=n, eos_token_id=None)
    cached = model.generate(x[:, :9], **kwargs)
    fresh = model.generate(x[:, :9], use_cache=False, **kwargs)
    assert torch.equal(cached, fresh), mode
tokenizer = AutoTokenizer.from_pretrained(export, trust_remote_code=True)
assert tokenizer.decode(tokenizer("def main():").input_ids) == "def main():"
print(f"transformers {version}: logits = megatron's (max |diff| {worst:.1e}), cached = uncached in 3 modes, tokenizer ok")
"""


@pytest.fixture(scope="module")
def export_with_expected(tiny_run, tiny_export, tmp_path_factory):
    """(export folder, file of megatron's logits after 1–3 passes over 2 × 12 tokens)."""
    from safetensors.torch import save_file

    from fbt_megatron.evaluation.tasks.evaluate import pass_logits
    from fbt_megatron.inference.runs import load_run

    base = tmp_path_factory.mktemp("versions")
    export = tiny_export
    model = load_run(str(tiny_run)).model.eval()
    x = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = {f"pass{k}": logits.contiguous() for k, logits in enumerate(pass_logits(model, x, 3), start=1)}
    save_file({**expected, "tokens": x}, str(base / "expected.safetensors"))
    return export, base / "expected.safetensors"


@pytest.mark.parametrize("version", [LOWEST, NEWEST])
def test_export_on_transformers(version, export_with_expected):
    target = Path(os.environ.get(TARGETS, "/nonexistent")) / version
    if not (target / "transformers").is_dir():
        reason = (f"transformers {version} not prepared: pip install --no-deps --target $FBT_TRANSFORMERS_TARGETS/"
                  f"{version} transformers=={version} (.ci/run does)")
        if os.environ.get("FBT_REQUIRE_TRANSFORMERS_VERSIONS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    export, expected = export_with_expected
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               HF_HOME=str(expected.parent / "hf"))
    out = subprocess.run([sys.executable, "-c", CHECK, str(export), str(expected), version], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    print(out.stdout.strip().splitlines()[-1])


def test_model_card_has_no_local_paths(export_with_expected, tiny_run):
    export, _ = export_with_expected
    card = (export / "README.md").read_text()
    assert str(Path(tiny_run).resolve()) not in card and str(export.resolve()) not in card
    assert not re.search(r"(?<![\w.~])/(?:tmp|work|home|root|Users|mnt|scratch)/", card), card
    assert f"`{Path(tiny_run).name}`" in card  # the run is named, not located
