"""lm-eval on the Hugging Face export (``fbt_megatron.evaluation``, its ``table`` command): the local tasks,
the ``fbt`` lm-eval model's decode modes against independent computations, plain ``lm-eval --model
hf`` offline, the evaluation table, and one ``error:`` line for bad input."""

import collections
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fbt_megatron.common.cli import run_cli
from fbt_megatron.evaluation.local_tasks import NEXT_LINE, PERPLEXITY, build_tasks, ensure_tasks
from fbt_megatron.model.decode_modes import parse_mode

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 4  # items per task in the lm-eval runs


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- the local tasks
def test_local_tasks_are_deterministic_and_sane(tmp_path):
    a = build_tasks(str(tmp_path / "a"), documents=12, questions=80)
    b = build_tasks(str(tmp_path / "b"), documents=12, questions=80)
    for name in ("perplexity.jsonl", "next_line.jsonl"):
        assert (Path(a.folder) / name).read_bytes() == (Path(b.folder) / name).read_bytes()
    for task in (PERPLEXITY, NEXT_LINE):  # the YAMLs differ only in the folder they name
        ya, yb = ((Path(t.folder) / f"{task}.yaml").read_text() for t in (a, b))
        assert ya.replace(a.folder, "X") == yb.replace(b.folder, "X")
        assert f'test: "{a.folder}/' in ya and "dataset_path: json" in ya and f"task: {task}" in ya

    docs = [json.loads(line) for line in (Path(a.folder) / "perplexity.jsonl").read_text().splitlines()]
    assert len(docs) == 12 and all(0 < len(d["text"]) <= 1200 for d in docs)
    assert len({d["name"].split("#")[0] for d in docs}) >= 10  # spread over the held-out modules
    items = [json.loads(line) for line in (Path(a.folder) / "next_line.jsonl").read_text().splitlines()]
    assert len(items) == 80
    counts = collections.Counter(i["label"] for i in items)
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) >= 10  # the answer's place is not guessable
    held_out = {json.loads(line)["name"]: json.loads(line)["text"]
                for line in (ROOT / "data/stdlib-sp2048/docs.valid.jsonl").read_text().splitlines()} \
        if (ROOT / "data/stdlib-sp2048/docs.valid.jsonl").is_file() else None
    for item in items:
        choices, answer = item["choices"], item["choices"][item["label"]]
        assert len(choices) == 4 and len(set(choices)) == 4 and item["context"].endswith("\n")
        if held_out is not None:
            name, line = item["name"].rsplit(":", 1)
            lines = held_out[name].splitlines()
            assert lines[int(line) - 1].rstrip() == answer and item["context"].endswith(lines[int(line) - 2].rstrip() + "\n")
            assert sum(c in held_out[name].splitlines() for c in choices) >= 1
    manifest = json.loads((Path(a.folder) / "tasks.json").read_text())
    assert manifest["tasks"] == {PERPLEXITY: 12, NEXT_LINE: 80}
    # reused when built with the same settings, rebuilt otherwise
    stamp = (Path(a.folder) / "next_line.jsonl").stat().st_mtime_ns
    assert ensure_tasks(a.folder, documents=12, questions=80).questions == 80
    assert (Path(a.folder) / "next_line.jsonl").stat().st_mtime_ns == stamp
    assert ensure_tasks(a.folder, documents=12, questions=20).questions == 20


def test_decode_mode_names():
    assert parse_mode("standard") == ("standard", 0) and parse_mode("soft") == ("soft", 0)
    assert parse_mode("fused(2)") == ("fused", 2) == parse_mode("fused", 2) == parse_mode("fused2") == parse_mode("fused", "2")
    for bad in ("greedy", "soft(1)", "fused(-1)"):
        with pytest.raises(ValueError):
            parse_mode(bad)
    with pytest.raises(ValueError):
        parse_mode("soft", 2)


# ---------------------------------------------------------------- an export of a trained tiny run
@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_run, tiny_export):
    """(run folder, export folder, tasks) of a 4-step tiny FBT run, exported with the converter."""
    base = tmp_path_factory.mktemp("eval")
    run, export = tiny_run, tiny_export
    tasks = build_tasks(str(base / "tasks"), documents=6, questions=12)
    return run, export, tasks


@pytest.fixture(scope="module")
def fbt_lm(exported):
    from fbt_megatron.evaluation.lm import FBTLM

    return FBTLM(pretrained=str(exported[1]), batch_size=4)


def offline_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               OMP_NUM_THREADS="1")
    return env


def requests_from_text(lm, text: str, splits):
    """(key, context tokens, continuation tokens) for (split, length) pairs: the context is
    ``text`` up to the character offset split, the continuation the next length characters;
    encoded as lm-eval encodes a pair."""
    out = []
    for s, n in splits:
        ctx, cont = lm._encode_pair(text[:s], text[s:s + n])
        out.append(((text[:s], text[s:s + n]), ctx, cont))
    return out


def test_soft_and_fused_loglikelihoods_match_independent_computations(fbt_lm, exported):
    lm, model = fbt_lm, fbt_lm.model
    text = json.loads((Path(exported[2].folder) / "perplexity.jsonl").read_text().splitlines()[0])["text"]
    requests = requests_from_text(lm, text, ((60, 40), (75, 40), (200, 40), (200, 12), (200, 25)))  # 3 share a prompt
    lm.decode_mode, lm.fused_prefill_passes = "soft", 0
    soft = lm._loglikelihood_tokens(requests)
    for ((_, ctx, cont), (ll, _)) in zip(requests, soft):
        # soft decoding of a prompt of p tokens = the k-pass forward with prefix p, k = T − p + 1
        ids = torch.tensor([ctx + cont[:-1]])
        p, T = len(ctx), ids.shape[1]
        with torch.no_grad():
            logits = model(input_ids=ids, num_passes=T - p + 1, prefix_len=p, use_cache=False).logits
        expected = torch.log_softmax(logits[0, p - 1:], -1).gather(-1, torch.tensor(cont)[:, None]).sum().item()
        assert ll == pytest.approx(expected, rel=1e-5, abs=1e-4)

    lm.decode_mode, lm.fused_prefill_passes = "fused", 2
    fused = lm._loglikelihood_tokens(requests)
    for ((_, ctx, cont), (ll, _)) in zip(requests, fused):
        ids = torch.tensor([ctx + cont[:-1]])
        # the continuation's first token: the 3-pass forward over the prompt (prefix 0)
        with torch.no_grad():
            first = model(input_ids=torch.tensor([ctx]), num_passes=3, use_cache=False).logits[0, -1]
            rows = model.decode_logits(ids, len(ctx), decode_mode="fused", fused_prefill_passes=2)[0, len(ctx) - 1:]
        assert rows[0].tolist() == pytest.approx(first.tolist(), rel=1e-4, abs=1e-4)
        expected = torch.log_softmax(rows, -1).gather(-1, torch.tensor(cont)[:, None]).sum().item()
        assert ll == pytest.approx(expected, rel=1e-6, abs=1e-5)
    assert all(math.isfinite(a[0]) and a[0] != b[0] for a, b in zip(soft, fused))

    # requests batched together (right-padded) or one by one, in any order: the same numbers in the caller's order
    one_by_one = [lm._loglikelihood_tokens([r])[0][0] for r in reversed(requests)][::-1]
    assert one_by_one == pytest.approx([f[0] for f in fused], rel=1e-5)


def test_the_fbt_model_decodes_in_the_exports_default_mode(exported):
    """Without decode_mode, lm-eval's fbt model takes the export's default (soft for an FBT model)."""
    from fbt_megatron.evaluation.lm import FBTLM

    assert FBTLM(pretrained=str(exported[1]), batch_size=4).mode == "soft"
    assert FBTLM(pretrained=str(exported[1]), batch_size=4, fused_prefill_passes=2).mode == "fused(2)"


def test_generation_gets_the_decode_mode(fbt_lm):
    """lm-eval's generate_until path (``_model_generate``) decodes in the model's mode."""
    lm, model = fbt_lm, fbt_lm.model
    prompt = torch.tensor([lm.tok_encode("import os\nimport sys\n\ndef main(")])
    for mode, n in (("soft", 0), ("fused", 2), ("standard", 0)):
        lm.decode_mode, lm.fused_prefill_passes = mode, n
        out = lm._model_generate(prompt, max_length=prompt.shape[1] + 6, stop=["\n\n\n"])
        with torch.no_grad():
            direct = model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, decode_mode=mode,
                                    fused_prefill_passes=n, pad_token_id=lm.tokenizer.pad_token_id)
        assert out.tolist() == direct.tolist(), mode


def test_plain_lm_eval_hf_runs_on_the_export_and_fbt_standard_matches_it(fbt_lm, exported, tmp_path):
    """``lm-eval run --model hf`` (lm-eval's own CLI and model, offline) on the export; the fbt
    model in standard mode gives the same numbers; soft and fused(1) finite and different ones."""
    from fbt_megatron.evaluation.harness import ExportEvaluator, table_row

    _, export, tasks = exported
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf",
           "--model_args", f"pretrained={export},trust_remote_code=True,dtype=float32",
           "--tasks", f"{PERPLEXITY},{NEXT_LINE}", "--include_path", tasks.folder, "--device", "cpu",
           "--batch_size", "4", "--limit", str(LIMIT), "--output_path", str(tmp_path / "out")]
    run = subprocess.run(cmd, cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (result_file,) = (tmp_path / "out").rglob("results_*.json")
    hf = json.loads(result_file.read_text())["results"]

    evaluator = ExportEvaluator(str(export), lm=fbt_lm)
    def measured(row):  # the columns of the tasks run here (the table's other tasks are None)
        return {column: value for column, value in row.items() if value is not None}

    rows = {mode: measured(table_row(evaluator.evaluate(mode, tasks, limit=LIMIT))) for mode in ("standard", "soft", "fused(1)")}
    assert len(rows["standard"]) >= 4 and rows["standard"] == pytest.approx(measured(table_row(hf)), rel=1e-5)
    for mode in ("soft", "fused(1)"):
        assert all(math.isfinite(v) for v in rows[mode].values())
        assert rows[mode]["bits_per_byte"] != pytest.approx(rows["standard"]["bits_per_byte"], rel=1e-6)
    assert rows["soft"]["bits_per_byte"] != pytest.approx(rows["fused(1)"]["bits_per_byte"], rel=1e-6)


def test_lm_eval_cli_with_the_fbt_model(exported, tmp_path, monkeypatch):
    """``python -m fbt_megatron.evaluation lm-eval`` is lm-eval's CLI with ``--model fbt`` registered."""
    from fbt_megatron.evaluation.__main__ import main

    _, export, tasks = exported
    monkeypatch.chdir(tmp_path)
    assert main(["lm-eval", "run", "--model", "fbt", "--model_args",
                 f"pretrained={export},decode_mode=fused,fused_prefill_passes=1", "--tasks", NEXT_LINE,
                 "--include_path", tasks.folder, "--batch_size", "4", "--limit", "2",
                 "--output_path", str(tmp_path / "out")]) == 0
    (result_file,) = (tmp_path / "out").rglob("results_*.json")
    result = json.loads(result_file.read_text())
    assert 0 <= result["results"][NEXT_LINE]["acc,none"] <= 1
    assert result["config"]["model_args"]["decode_mode"] == "fused" and result["config"]["model_args"]["fused_prefill_passes"] == 1


# ---------------------------------------------------------------- python -m fbt_megatron.evaluation table
def eval_table(capsys, *args):
    """``python -m fbt_megatron.evaluation table``'s exit code and stderr for ``args`` (in this process)."""
    from fbt_megatron.evaluation.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: main(["table", *map(str, args)]))
    return exit_.value.code, capsys.readouterr().err


def test_eval_table_writes_the_table(exported, tmp_path, capsys):
    run, export, tasks = exported
    baseline = tmp_path / "baseline-export"  # the export as a model without latent feedback
    shutil.copytree(export, baseline)
    config = json.loads((baseline / "config.json").read_text())
    (baseline / "config.json").write_text(json.dumps({**config, "latent_feedback": False, "decode_mode": "standard"}))
    out = tmp_path / "results" / "table.md"
    code, err = eval_table(capsys, run, baseline, "--output", out, "--modes", "standard", "soft", "fused(2)",
                          "--limit", 2, "--tasks-dir", tasks.folder, "--documents", 6, "--questions", 12)
    assert code == 0, err[-3000:]
    lines = out.read_text().splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert table[0] == ("| model | mode | word perplexity ↓ | bits per byte ↓ | next line acc ↑ | next line acc_norm ↑ "
                        "| own split word perplexity ↓ | own split bits per byte ↓ |")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[1:]]
    name = Path(run).name  # models are named after their folders
    assert [r[:2] for r in rows] == [[name, "standard"], [name, "soft"], [name, "fused(2)"], ["baseline-export", "standard"]]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["columns"] == ["word_perplexity", "bits_per_byte", "acc", "acc_norm", "split_word_perplexity",
                               "split_bits_per_byte"]
    for row in data["rows"]:  # the run also on its own held-out split (the embedded corpus's); an export has none
        own = row["model"] == name
        assert all(math.isfinite(row[c]) if own or not c.startswith("split") else row[c] is None for c in data["columns"])
        assert 0 <= row["acc"] <= 1
    assert data["rows"][0]["bits_per_byte"] != data["rows"][1]["bits_per_byte"]
    # the run was exported with the converter into the cache beside the output
    assert (tmp_path / "results" / "exports" / f"{name}-iter4" / "config.json").is_file()
    assert data["details"][0]["iteration"] == 4 and data["details"][0]["export"].endswith(f"{name}-iter4")


def test_eval_table_bad_input_is_one_error_line(exported, tmp_path, capsys):
    _, export, _ = exported
    for args, message in (([export, "--modes", "greedy"], "unknown decode mode 'greedy'"),
                          ([export, "--modes", "soft(2)"], "only fused takes a number of passes"),
                          ([tmp_path / "missing"], "no such run folder or export"),
                          ([tmp_path], "neither a run folder"),
                          *([([export, "--backend", "vllm"], "--backend vllm needs vLLM, which this environment lacks: "
                                                             "pip install -r requirements-serve.txt")]
                            if importlib.util.find_spec("vllm") is None else [])):
        code, err = eval_table(capsys, *args, "--output", tmp_path / "t.md")
        assert code == 2 and err.startswith("error: ") and message in err, err
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t.md").exists()
