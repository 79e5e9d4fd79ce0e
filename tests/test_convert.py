"""Checkpoint conversion to and from Hugging Face format (``python -m fbt_megatron.convert``).

* An export of a trained run loads offline with AutoModelForCausalLM / AutoTokenizer
  (trust_remote_code) and computes megatron's logits (fp32, 1e-5): the k-pass forward for
  k = 1..3 with and without a prefix, and standard / soft / fused decoding.
* Runs trained at TP2 and PP2 export to what their one-process load computes (slow).
* export → import → export is bit-exact; the imported checkpoint loads (runs.load_run) with the
  original's weights exactly.
* A tiny Llama (and Mistral with a sliding window, Qwen3 with q/k norms) imports as an FBT model
  whose standard logits are the HF model's (the decisive test of the mapping); training starts
  from the import at TP2 (slow). Untied, biased or otherwise unmappable checkpoints are one line,
  nothing written.
* Bad inputs: one ``error:`` line, exit code 2, nothing written. An output folder may be new below
  missing parents or empty; one that is not empty is refused.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import launch
from test_train import train

from fbt_megatron.inference.convert import ConversionError
from fbt_megatron.inference.convert.from_hf import import_checkpoint
from fbt_megatron.inference.convert.to_hf import export
from fbt_megatron.inference.runs import load_run
from fbt_megatron.model.fbt import Feedback, fuse_mask, run_pass
from fbt_megatron.common.processes import outside_group

ROOT = Path(__file__).parent.parent
TOL = 1e-5
RUN_FLAGS = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
             "--eval-interval", "4", "--eval-iters", "1", "--lr-warmup-iters", "1", "--log-interval", "4"]


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    """Hugging Face offline, its caches (remote code modules) in a private folder."""
    home = tmp_path_factory.mktemp("hf_home")
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(home))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_corpus):
    """A 4-step run of the tiny FBT recipe on the small corpus, and its export."""
    root = tmp_path_factory.mktemp("convert")
    train(root / "train.log", *RUN_FLAGS, "--save", str(root / "run"), corpus=small_corpus)
    export(str(root / "run"), str(root / "hf"), say=quiet)
    return root


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32).eval()


def megatron_logits(model, tokens: torch.Tensor, num_passes: int, prefix: int = 0) -> torch.Tensor:
    """The k-pass teacher-forced forward in eval mode with a fixed prefix (training's semantics)."""
    b, s = tokens.shape
    feedback = lambda state, j: Feedback(state, fuse_mask(torch.full((b,), prefix), s, state.device))  # noqa: E731
    state = None
    with torch.no_grad():
        for j in range(1, num_passes + 1):
            logits, state = run_pass(model, tokens, None, j, state, feedback)
    return logits


def sample_tokens(vocab: int, batch=2, seq=48, seed=0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def files_digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.safetensors"))}


# ---------------------------------------------------------------- the export
def test_export_loads_offline_and_computes_megatrons_logits(trained):
    from transformers import AutoTokenizer

    hf = trained / "hf"
    names = {p.name for p in hf.iterdir()}
    assert {"config.json", "configuration_fbt.py", "modeling_fbt.py", "tokenization_fbt.py", "model.safetensors",
            "tokenizer.model", "tokenizer_config.json", "generation_config.json", "README.md"} <= names
    for name in ("configuration_fbt.py", "modeling_fbt.py", "tokenization_fbt.py"):  # verbatim copies
        assert (hf / name).read_bytes() == (ROOT / "fbt_megatron" / "inference" / "convert" / "hf" / name).read_bytes()
    config = json.loads((hf / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2 and config["sliding_window"] == 32
    assert config["residual_scale"] == pytest.approx(1 / 8**0.5) and config["vocab_size"] == 512
    assert "| `residual_scale` |" in (hf / "README.md").read_text()

    run = load_run(str(trained / "run"))
    model = hf_model(hf)
    tokens = sample_tokens(512)  # longer than the window (32): windowed and global layers differ
    for k in (1, 2, 3):
        for prefix in (0, 5):
            if k == 1 and prefix:
                continue
            with torch.no_grad():
                got = model(tokens, num_passes=k, prefix_len=prefix).logits
            torch.testing.assert_close(got, megatron_logits(run.model, tokens, k, prefix), atol=TOL, rtol=0)

    tokenizer = AutoTokenizer.from_pretrained(str(hf), trust_remote_code=True)
    text = "import os\n\ndef main(argv):\n    return sorted(argv)  # done\n"
    assert tokenizer(text)["input_ids"] == run.tokenizer.tokenize(text)
    assert tokenizer.decode(run.tokenizer.tokenize(text)) == text
    assert tokenizer.eos_token_id == run.tokenizer.eod == config["eos_token_id"]


def test_the_export_stands_alone(trained, tmp_path):
    """A fresh process, offline, with an empty Hugging Face cache, outside the repository, loads the
    export without importing fbt_megatron and computes the megatron logits."""
    tokens = sample_tokens(512, seed=7)
    torch.save(tokens, tmp_path / "tokens.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"d = {str(trained / 'hf')!r}\n"
        "m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()\n"
        "tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)\n"
        "assert tok('def f(x):').input_ids\n"
        "with torch.no_grad():\n"
        "    out = m(torch.load('tokens.pt'), num_passes=2, prefix_len=3).logits\n"
        "torch.save(out, 'logits.pt')\n"
        "assert not [k for k in sys.modules if k.startswith('fbt_megatron')], 'the export imports fbt_megatron'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = megatron_logits(load_run(str(trained / "run")).model, tokens, 2, 3)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=TOL, rtol=0)


def test_decoding_logits_equal_megatrons_generation(trained):
    from fbt_megatron.inference import generate as generate_api
    run = load_run(str(trained / "run"))
    model = hf_model(trained / "hf")
    tokens = sample_tokens(512, batch=2, seq=40, seed=1)
    p = 30
    prompts, continuations = tokens[:, :p].tolist(), tokens[:, p:].tolist()
    for mode, n in (("standard", 0), ("soft", 0), ("fused", 2)):
        expected = generate_api.forced_logits(run.model, prompts, continuations, mode=mode, fused_passes=n)
        got = model.decode_logits(tokens, p, decode_mode=mode, fused_prefill_passes=n)
        for i in range(len(prompts)):
            torch.testing.assert_close(got[i, p - 1 :], expected[i], atol=TOL, rtol=0, msg=f"{mode}({n}) row {i}")

        # greedy generation: the same tokens
        out = generate_api.generate(run.model, prompts, mode=mode, fused_passes=n, max_new_tokens=6)
        with torch.no_grad():
            hf_out = model.generate(tokens[:, :p], max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                    decode_mode=mode, fused_prefill_passes=n, pad_token_id=0, eos_token_id=None)
        assert hf_out[:, p:].tolist() == out.tokens, mode


def test_one_default_mode_soft_for_fbt(trained):
    """Told no mode, the run (``generate``), its export (``generate``, ``pipeline``) and lm-eval's
    ``fbt`` model all decode soft, which differs from standard for these prompts; the export's
    config.json says so. (vLLM without ``vllm_xargs``: tests/test_serving.py.)"""
    from transformers import AutoTokenizer, pipeline

    from fbt_megatron.inference.generate import generate

    hf = trained / "hf"
    assert json.loads((hf / "config.json").read_text())["decode_mode"] == "soft"
    run, model = load_run(str(trained / "run")), hf_model(hf)
    prompts = sample_tokens(512, batch=2, seq=30, seed=2).tolist()
    soft = generate(run.model, prompts, mode="soft", max_new_tokens=8).tokens
    assert generate(run.model, prompts, max_new_tokens=8).tokens == soft
    assert generate(run.model, prompts, mode="standard", max_new_tokens=8).tokens != soft
    with torch.no_grad():
        out = model.generate(torch.tensor(prompts), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    assert out[:, 30:].tolist() == soft
    tokenizer = AutoTokenizer.from_pretrained(str(hf), trust_remote_code=True)
    text = "def main(argv):\n    "
    ids = tokenizer(text).input_ids
    expected = generate(run.model, [ids], mode="soft", max_new_tokens=8).tokens[0]
    piped = pipeline("text-generation", model=model, tokenizer=tokenizer)(
        text, max_new_tokens=8, min_new_tokens=8, do_sample=False, return_tensors=True)
    assert piped[0]["generated_token_ids"][len(ids):] == expected


def synthetic_run(folder: Path, tokenizer: str, iteration: int = 3, **model) -> Path:
    """A run folder holding random weights (norms too) of a tiny model with ``model`` overrides."""
    from fbt_megatron.inference.runs import build_inference_model
    from fbt_megatron.model.config import recipe_config as model_config
    from fbt_megatron.recipe import recipe_from_dict
    from fbt_megatron.trainer import checkpointing
    from fbt_megatron.trainer.checkpointing import TrainState

    recipe = recipe_from_dict({"model": {"preset": "tiny", **model}, "training": {"seed": 5},
                               "data": {"data_path": None, "corpus": None, "tokenizer_model": tokenizer, "seq_length": 64}})
    torch.manual_seed(5)
    net = build_inference_model(model_config(recipe, 512))
    with torch.no_grad():
        for name, p in net.named_parameters():
            (p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.05))
    state = TrainState(iteration=iteration, model=recipe.to_dict()["model"], recipe=recipe.to_dict(), vocab_size=512)
    checkpointing.save(folder, iteration, net, None, None, vars(state))
    return folder


@pytest.mark.parametrize("model", [
    dict(latent_feedback=False),  # the baseline: no fusion weights, standard only
    dict(feedback_state="final_norm", sandwich_norm=False, headwise_attention_gate=False, qk_layernorm=False,
         sliding_window=None, full_attention_every=None, depth_scale=0.7, num_query_groups=4, rotary_base=500.0),
    dict(sliding_window=8, full_attention_every=None, num_query_groups=1, layernorm_epsilon=1e-5),
], ids=["baseline", "final_norm_plain", "all_windowed_mqa"])
def test_every_architecture_variant_exports_exactly(tmp_path, small_corpus, model):
    run = synthetic_run(tmp_path / "run", small_corpus.tokenizer_path, **model)
    hf = export(str(run), str(tmp_path / "hf"), say=quiet)
    net, exported = load_run(str(run)).model, hf_model(hf)
    tokens = sample_tokens(512, seq=40, seed=6)
    for k in (1, 2, 3) if model.get("latent_feedback", True) else (1,):
        with torch.no_grad():
            got = exported(tokens, num_passes=k, prefix_len=4).logits
        torch.testing.assert_close(got, megatron_logits(net, tokens, k, 4), atol=TOL, rtol=0)
    if not model.get("latent_feedback", True):
        from safetensors.torch import load_file

        assert not [n for n in load_file(str(hf / "model.safetensors")) if "feedback" in n]
    again = import_checkpoint(str(hf), str(tmp_path / "back"), say=quiet)
    third = export(str(again), str(tmp_path / "hf2"), say=quiet)
    assert files_digest(third) == files_digest(hf)


def test_a_run_without_a_sentencepiece_tokenizer_exports_the_model_alone(tmp_path):
    import tokenizers

    vocab = {"</s>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate("abcdefgh")}}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    run = synthetic_run(tmp_path / "run", str(tmp_path / "tokenizer.json"))
    said = []
    hf = export(str(run), str(tmp_path / "hf"), say=said.append)
    assert [line for line in said if line.startswith("note: no tokenizer exported")] == [
        "note: no tokenizer exported: the run's tokenizer tokenizer.json is a huggingface tokenizer (only sentencepiece is exported)"]
    assert not list(hf.glob("tokeniz*")) and not (hf / "special_tokens_map.json").exists()
    config = json.loads((hf / "config.json").read_text())
    assert "AutoTokenizer" not in config["auto_map"] and config["eos_token_id"] == 0
    assert "no tokenizer exported" in (hf / "README.md").read_text()
    tokens = sample_tokens(512, seq=20, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(hf)(tokens).logits, megatron_logits(load_run(str(run)).model, tokens, 1),
                                   atol=TOL, rtol=0)


@pytest.mark.slow
def test_any_layout_exports_what_one_process_loads(tmp_path, small_corpus):
    """A TP 2 × PP 2 run (both kinds of sharding in one launch) exports what one process loads."""
    run = tmp_path / "run"
    code, text = launch(tmp_path / "train.log", "-m", "fbt_megatron.train", "--recipe", ROOT / "recipes" / "tiny_cpu.yaml",
                        "--threads", "1", "--data-path", Path(small_corpus.train_prefix).parent, "--corpus", "null",
                        *RUN_FLAGS, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                        "--save", run, nproc=4)
    assert code == 0, text[-3000:]
    export(str(run), str(tmp_path / "hf"), say=quiet)
    tokens = sample_tokens(512, seed=2)
    expected = megatron_logits(load_run(str(run)).model, tokens, 2, 3)
    with torch.no_grad():
        got = hf_model(tmp_path / "hf")(tokens, num_passes=2, prefix_len=3).logits
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def test_export_import_export_is_bit_exact(trained, tmp_path):
    imported = import_checkpoint(str(trained / "hf"), str(tmp_path / "run"), say=quiet)
    again = export(str(imported), str(tmp_path / "hf"), max_shard_size="60KB", say=quiet)  # sharded this time
    assert len(files_digest(again)) > 1 and (again / "model.safetensors.index.json").is_file()

    from safetensors.torch import load_file

    first = load_file(str(trained / "hf" / "model.safetensors"))
    second = {}
    for f in again.glob("*.safetensors"):
        second.update(load_file(str(f)))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((again / "config.json").read_text()) == json.loads((trained / "hf" / "config.json").read_text())

    # unsharded: the very same bytes
    third = export(str(imported), str(tmp_path / "hf3"), say=quiet)
    assert files_digest(third) == files_digest(trained / "hf")

    original, loaded = load_run(str(trained / "run")), load_run(str(imported))
    assert loaded.iteration == 0 and loaded.tokenizer_path == str((imported / "tokenizer.model").resolve())
    a, b = original.model.state_dict(), loaded.model.state_dict()
    tensors = [k for k, v in a.items() if torch.is_tensor(v)]
    assert tensors == [k for k, v in b.items() if torch.is_tensor(v)]
    assert all(torch.equal(a[k], b[k]) for k in tensors)
    recipe = (imported / "recipe.yaml").read_text()
    assert "sliding_window: 32" in recipe and json.loads((imported / "import.json").read_text())["model_type"] == "fbt"


# ---------------------------------------------------------------- Llama-style checkpoints
def tiny_hf(kind: str, folder: Path, tokenizer=None, **overrides) -> Path:
    """A tiny random HF model of `kind` (llama, mistral, qwen3), tied embeddings, saved to `folder`."""
    import transformers

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, rms_norm_eps=1e-5)
    if kind == "llama":
        config = transformers.LlamaConfig(**shape, head_dim=24, rope_theta=5000.0)  # head_dim ≠ hidden/heads
    elif kind == "mistral":
        config = transformers.MistralConfig(**shape, sliding_window=8)
    else:
        config = transformers.Qwen3Config(**shape, head_dim=16)
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(3)
    model = getattr(transformers, {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                   "qwen3": "Qwen3ForCausalLM"}[kind])(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            (p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.1))
    model.save_pretrained(str(folder))
    if tokenizer:
        shutil.copyfile(tokenizer, folder / "tokenizer.model")
    return folder


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3"])
def test_a_llama_style_checkpoint_imports_with_its_logits(tmp_path, small_corpus, kind):
    import transformers

    source = tiny_hf(kind, tmp_path / kind, tokenizer=small_corpus.tokenizer_path)
    run = import_checkpoint(str(source), str(tmp_path / "run"), say=quiet)
    loaded = load_run(str(run))
    c = loaded.model.config
    assert (c.sandwich_norm, c.headwise_attention_gate, c.depth_scale, c.qk_layernorm) == (False, False, 1.0, kind == "qwen3")
    assert c.sliding_window == (8 if kind == "mistral" else None) and c.full_attention_every is None
    fusion = loaded.model.feedback_fusion
    assert torch.equal(fusion.norm.weight, torch.ones(64)) and 0.015 < fusion.linear_state.weight.std() < 0.025

    tokens = sample_tokens(512, seq=24, seed=4)  # longer than Mistral's window (8)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(tokens).logits
        got, _ = loaded.model(tokens)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)

    # and on to Hugging Face again: the FBT export's standard mode is the same model
    exported = export(str(run), str(tmp_path / "fbt_hf"), say=quiet)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(exported)(tokens).logits, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("change, message", [
    (dict(tie_word_embeddings=False), "untied"),
    (dict(attention_bias=True), "biases"),
    (dict(hidden_act="gelu"), "activation"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "RoPE scaling"),
])
def test_what_cannot_map_is_refused_with_nothing_written(tmp_path, change, message):
    source = tiny_hf("llama", tmp_path / "llama", **change)
    with pytest.raises(ConversionError, match=message) as e:
        import_checkpoint(str(source), str(tmp_path / "run"), say=quiet)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]


@pytest.mark.slow
def test_training_at_tp2_starts_from_an_import(tmp_path, small_corpus):
    source = tiny_hf("llama", tmp_path / "llama", tokenizer=small_corpus.tokenizer_path)
    run = import_checkpoint(str(source), str(tmp_path / "run"), tensor_model_parallel_size=2, say=quiet)
    code, text = launch(tmp_path / "train.log", "-m", "fbt_megatron.train", "--recipe", run / "recipe.yaml", "--load", run,
                        "--save", tmp_path / "tuned", "--data-path", Path(small_corpus.train_prefix).parent,
                        "--tensor-model-parallel-size", "2", "--threads", "1", *RUN_FLAGS[:6], "--train-iters", "2",
                        "--eval-iters", "0", "--lr-warmup-iters", "0", "--log-interval", "1", "--passes", "2", nproc=2)
    assert code == 0, text[-3000:]
    # its first loss is the imported model's on the first batch, computed here by one process
    from fbt_megatron.inference.runs import run_recipe
    from fbt_megatron.model.fbt import masked_mean
    from fbt_megatron.trainer.data import build_data
    from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics
    from fbt_megatron.trainer.step import microbatches

    recipe, _ = run_recipe(str(tmp_path / "tuned"))
    model = load_run(str(run)).model
    losses = []
    with torch.no_grad():
        for batch in microbatches(build_data(recipe, 0).train, 0, recipe, 0, 1):
            loss, _ = model(batch["tokens"], labels=batch["labels"])
            losses.append(masked_mean(loss, batch["loss_mask"]).item())
    logged = read_metrics(tmp_path / "tuned")[0]
    assert logged["step"] == 1 and logged["pass_losses"][0] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


# ---------------------------------------------------------------- bad inputs
def cli(*args):
    env = outside_group()
    run = subprocess.run([sys.executable, "-m", "fbt_megatron.convert", *map(str, args)], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=300)
    return run.returncode, run.stderr


def test_bad_inputs_are_one_error_line(trained, tmp_path):
    from fbt_megatron.commands.convert import main

    (tmp_path / "empty_run").mkdir()
    damaged = tmp_path / "damaged"
    shutil.copytree(trained / "run", damaged)
    next((damaged / "iter_0000004").glob("*.distcp")).write_bytes(b"x")
    (tmp_path / "not_hf").mkdir()
    (tmp_path / "no_weights").mkdir()
    shutil.copyfile(trained / "hf" / "config.json", tmp_path / "no_weights" / "config.json")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    cases = [
        (["to-hf", "--load", tmp_path / "missing", "--output", tmp_path / "o1"], "no such run folder"),
        (["to-hf", "--load", tmp_path / "empty_run", "--output", tmp_path / "o2"], "no checkpoint"),
        (["to-hf", "--load", damaged, "--output", tmp_path / "o3"], "is damaged"),
        (["to-hf", "--load", trained / "run", "--output", trained / "hf"], "exists and is not empty: choose another --output"),
        (["to-hf", "--load", trained / "run", "--output", tmp_path / "o4", "--ckpt-step", "3"], "--ckpt-step 3"),
        (["to-hf", "--load", trained / "run", "--output", tmp_path / "o5", "--max-shard-size", "lots"], "--max-shard-size"),
        (["from-hf", "--input", tmp_path / "not_hf", "--save", tmp_path / "r1"], "not a Hugging Face model folder"),
        (["from-hf", "--input", tmp_path / "no_weights", "--save", tmp_path / "r5"], "has no model.safetensors"),
        (["from-hf", "--input", tmp_path / "gpt2", "--save", tmp_path / "r2"], "cannot import model_type 'gpt2'"),
        (["from-hf", "--input", trained / "hf", "--save", trained / "run"], "exists and is not empty: choose another --save"),
        (["from-hf", "--input", trained / "hf", "--save", tmp_path / "r3", "--tensor-model-parallel-size", "3"],
         "not divisible by --tensor-model-parallel-size 3"),
        (["convert-everything"], "invalid choice"),
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            main([str(a) for a in argv])
        assert "\n" not in str(e.value), e.value
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written

    code, err = cli("from-hf", "--input", tmp_path / "not_hf", "--save", tmp_path / "r4")
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    code, err = cli("nonsense")
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_output_folders_below_missing_parents_or_empty_are_written(trained, tmp_path):
    """Through the real CLI: the README's ``to-hf --output exports/NAME`` where ``exports/`` does not
    exist yet (a fresh clone) writes the export; ``from-hf --save`` into an empty folder made
    beforehand writes the run there; a folder that is not empty is refused in one line, untouched."""
    export_dir, run_dir, full = tmp_path / "exports" / "NAME", tmp_path / "empty", tmp_path / "full"
    run_dir.mkdir()
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    code, err = cli("to-hf", "--load", trained / "run", "--output", export_dir)
    assert code == 0, err
    assert files_digest(export_dir) == files_digest(trained / "hf")
    code, err = cli("from-hf", "--input", export_dir, "--save", run_dir)
    assert code == 0, err
    original, imported = load_run(str(trained / "run")).model.state_dict(), load_run(str(run_dir)).model.state_dict()
    assert all(torch.equal(original[k], imported[k]) for k, v in original.items() if torch.is_tensor(v))
    code, err = cli("to-hf", "--load", trained / "run", "--output", full)
    assert (code, err) == (2, f"error: {full} exists and is not empty: choose another --output or remove it\n")
    assert [p.name for p in full.iterdir()] == ["notes.txt"] and (full / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "exports", "full"]  # no temporary folder left
