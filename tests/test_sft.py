"""The SFT stage (fbt_megatron/data/sft/, data/packed_rows.py): the loss mask token by token, packed
rows against each conversation alone for every pass, bad records, and a run of the entry point."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from forked import run_commands
from helpers import build

from fbt_megatron.data.packed_rows import PackedRows
from fbt_megatron.data.sft import chat, packing
from fbt_megatron.data.tokenizer import load_tokenizer
from fbt_megatron.model import fbt
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

ROOT = Path(__file__).parent.parent
CONVERSATION = [
    {"role": "system", "content": "You answer questions."},
    {"role": "user", "content": "What does json.loads do?"},
    {"role": "assistant", "content": "Deserialize s to a Python object."},
    {"role": "user", "content": "Its parameters?"},
    {"role": "assistant", "content": "loads(s, **kw)"},
]


@pytest.fixture(scope="module")
def encoder(small_corpus):
    tokenizer = load_tokenizer(small_corpus.tokenizer_path)
    return chat.ChatEncoder(tokenizer, chat.DEFAULT_CHAT_TEMPLATE, "the default chat template")


def test_loss_mask_is_on_assistant_tokens_only(encoder):
    """The row of a known conversation, token by token, against its pieces tokenised by hand:
    the loss is on the assistant's content and end of turn, nothing else."""
    tok = encoder.tokenizer
    pieces = [("### system\nYou answer questions.\n", 0), ("### user\nWhat does json.loads do?\n", 0),
              ("### assistant\n", 0), ("Deserialize s to a Python object.\n", 1), (None, 1),
              ("### user\nIts parameters?\n", 0), ("### assistant\n", 0), ("loads(s, **kw)\n", 1), (None, 1)]
    ids, generated = [], []
    for text, is_assistant in pieces:
        piece = [tok.eod] if text is None else tok.tokenize(text)
        ids += piece
        generated += [is_assistant] * len(piece)

    got_ids, got_assistant = encoder.encode(CONVERSATION)
    assert got_ids.tolist() == ids and got_assistant.tolist() == [bool(g) for g in generated]

    n = len(ids) - 1
    dataset = packing.SFTDataset([chat.Conversation(got_ids, got_assistant)], seq_length=n + 5, seed=0, pad=tok.pad)
    row = dataset[0]
    assert row["tokens"][:n].tolist() == ids[:-1] and row["labels"][:n].tolist() == ids[1:]
    assert row["loss_mask"].tolist() == [float(g) for g in generated[1:]] + [0.0] * 5  # padding: no loss
    assert row["plain"][:n].tolist() == [not g for g in generated[:-1]]  # input tokens of the prompt
    assert row["segments"].tolist() == [0] * n + [1] * 5
    # the labels under the loss read back as the two replies, each ended by EOD
    labels = row["labels"][:n][row["loss_mask"][:n] == 1].tolist()
    first = labels.index(tok.eod)
    assert tok.detokenize(labels[:first]) == "Deserialize s to a Python object.\n"
    assert tok.detokenize(labels[first + 1:-1]) == "loads(s, **kw)\n" and labels[-1] == tok.eod


def _conversation(g: torch.Generator, length: int, prompt: int) -> chat.Conversation:
    ids = torch.randint(0, 1024, (length,), generator=g).numpy()
    return chat.Conversation(ids, np.arange(length) >= prompt)


def _pass_losses(model, tokens, labels, feedback_fn, packed=None, k=3):
    """Per-token losses [b, s] of passes 1..k (teacher-forced, as training runs them)."""
    losses, state = [], None
    with torch.no_grad():
        for j in range(1, k + 1):
            loss, state = fbt.run_pass(model, tokens, labels, j, state, feedback_fn, packed=packed)
            losses.append(loss)
    return losses


def test_packed_rows_equal_conversations_alone():
    """Three conversations packed into one row (one longer than the sliding window of 32): each
    one's per-token losses after 1, 2, 3 passes equal the conversation run alone as a plain
    sequence (megatron's causal/window masks, the pretraining fusion with prefix = its prompt)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(41, 9), (20, 6), (23, 11)]  # (tokens, prompt tokens): 40 + 19 + 22 = 81 positions
    conversations = [_conversation(g, n, p) for n, p in shapes]
    dataset = packing.SFTDataset(conversations, seq_length=96, seed=0, pad=0)
    assert len(dataset) == 1
    row = dataset.row(dataset.rows[0])
    as_batch = {k: torch.as_tensor(v).unsqueeze(0) for k, v in row.items()}
    packed = PackedRows(as_batch["segments"], as_batch["plain"])
    model = build(seq_length=96).eval()
    got = _pass_losses(model, as_batch["tokens"], as_batch["labels"],
                       fbt.default_feedback(model, as_batch["tokens"], [0], packed), packed)

    # no state crosses a boundary: each conversation's first position (and its prompt) stays plain
    feedback = fbt.default_feedback(model, as_batch["tokens"], [0], packed)(torch.zeros(96, 1, 64), 2)
    starts = packed.starts[0].nonzero().flatten().tolist()
    assert len(starts) == 4 and not feedback.fuse_mask[starts, 0].any()  # 3 conversations + the padding
    assert not (feedback.fuse_mask[:, 0] & as_batch["plain"][0]).any()
    model.train()  # the random prefix mixin (training) also never fuses a conversation's first position
    random = PackedRows(as_batch["segments"], as_batch["plain"], prompt_prefix=False)
    assert not fbt.default_feedback(model, as_batch["tokens"], [0], random)(torch.zeros(96, 1, 64), 2).fuse_mask[starts, 0].any()
    model.eval()

    worst = 0.0
    for member, start in zip(dataset.rows[0], starts):
        c = conversations[member]
        n, prompt = len(c.ids) - 1, int((~c.assistant).sum())
        tokens, labels = torch.as_tensor(c.ids[:-1]).unsqueeze(0), torch.as_tensor(c.ids[1:]).unsqueeze(0)
        plain_prefix = lambda state, j: fbt.Feedback(state, fbt.fuse_mask(torch.tensor([prompt]), n, state.device))  # noqa: E731
        alone = _pass_losses(model, tokens, labels, plain_prefix)
        for j, (a, b) in enumerate(zip(got, alone), 1):
            torch.testing.assert_close(a[0, start:start + n], b[0], rtol=0, atol=2e-5, msg=f"pass {j}, conversation {member}")
            worst = max(worst, (a[0, start:start + n] - b[0]).abs().max().item())
    print(f"packed vs alone, passes 1-3: max |Δ loss| = {worst:.2e} (RoPE positions not reset)")

    # negative control: without the conversations' attention mask the later conversations change
    unmasked = _pass_losses(model, as_batch["tokens"], as_batch["labels"],
                            fbt.default_feedback(model, as_batch["tokens"], [0], packed), None)
    second = slice(starts[1], starts[2])
    assert (unmasked[0][0, second] - got[0][0, second]).abs().max() > 1e-3


BAD = {
    "invalid JSON": '{"messages": [',
    "no messages": '{"turns": []}',
    "missing role": '{"messages": [{"content": "hi"}, {"role": "assistant", "content": "hello"}]}',
    "unknown role": '{"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "hello"}]}',
    "empty content": '{"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "hello"}]}',
    "no assistant turn": '{"messages": [{"role": "user", "content": "hi"}]}',
    "longer than the sequence": json.dumps({"messages": [{"role": "user", "content": "hi " * 200},
                                                         {"role": "assistant", "content": "hello"}]}),
}
GOOD = json.dumps({"messages": CONVERSATION[1:3]})


def test_bad_records_name_file_and_line_or_are_skipped_and_counted(encoder, tmp_path, capsys):
    for kind, line in BAD.items():
        path = tmp_path / f"{kind.replace(' ', '_')}.jsonl"
        path.write_text(f"{GOOD}\n\n{line}\n{GOOD}\n")
        with pytest.raises(ValueError) as e:
            chat.read_conversations(str(path), encoder, 64, skip_bad=False)
        assert str(e.value).startswith(f"{path}:3: ") and "--sft-skip-bad-records" in str(e.value), (kind, e.value)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join([GOOD, *BAD.values(), BAD["empty content"], GOOD]) + "\n")
    kept = chat.read_conversations(str(mixed), encoder, 64, skip_bad=True)
    assert len(kept) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"sft: skipped 8 bad records of {mixed} (2 empty content, 1 invalid JSON, 1 longer than the sequence, "
                   "1 missing role, 1 no assistant turn, 1 no messages, 1 unknown role)"]


@pytest.mark.slow
def test_a_tiny_set_another_process_finished_meanwhile_is_taken(small_corpus, tmp_path, monkeypatch):
    """Two runs started together on a missing SFT --data-path both prepare it: the one that finishes
    second keeps the first one's set (same settings), and refuses it at another sequence length."""
    from fbt_megatron.data.sft import tiny_set

    source = tmp_path / "src"
    source.mkdir()
    for name in ("a", "b", "c"):
        (source / f"{name}.py").write_text(f'def {name}(x):\n    """Return x."""\n    return x\n')
    write = tiny_set._write_set

    def write_while_another_finishes(output, *args):
        monkeypatch.setattr(tiny_set, "_write_set", write)
        tiny_set.ensure_sft_set(f"sft:{source}", output, small_corpus.tokenizer_path, 64)  # the other process
        write(output, *args)

    out = tmp_path / "set"
    monkeypatch.setattr(tiny_set, "_write_set", write_while_another_finishes)
    tiny_set.ensure_sft_set(f"sft:{source}", str(out), small_corpus.tokenizer_path, 64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set", "src"]  # its own temporary folder is gone
    assert json.loads((out / "sft.json").read_text())["settings"]["seq_length"] == 64
    with pytest.raises(ValueError, match="holds an SFT set prepared from other settings"):
        tiny_set.ensure_sft_set(f"sft:{source}", str(out), small_corpus.tokenizer_path, 32)


def test_sft_run_through_the_entry_point(small_corpus, tmp_path):
    """The tiny SFT set prepared from the corpus's source modules, 4 steps of 3 passes, validated
    after 0-3 fused passes; a bad record stops a run with one line and exit code 2, writing nothing."""
    data, run = tmp_path / "sft_set", tmp_path / "run"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f"{GOOD}\n{BAD['empty content']}\n")
    common = ["--recipe", ROOT / "recipes" / "sft_tiny_cpu.yaml", "--threads", "1", "--pretrained-checkpoint", "null",
              "--load", "null", "--tokenizer-model", small_corpus.tokenizer_path, "--micro-batch-size", "2",
              "--global-batch-size", "4", "--train-iters", "4", "--eval-interval", "4", "--eval-iters", "1",
              "--log-interval", "1", "--lr-warmup-iters", "1"]
    codes = run_commands("fbt_megatron.train", [  # 4 steps of 400 (--exit-interval): more rows than the set holds
        ([*common, "--data-path", data, "--corpus", f"sft:{small_corpus.source}", "--save", run, "--train-iters", "400",
          "--exit-interval", "4"], tmp_path / "ok.log", None),
        ([*common, "--data-path", "null", "--train-data-path", f"[{bad}]", "--save", tmp_path / "bad"],
         tmp_path / "bad.out", tmp_path / "bad.err"),
    ])
    assert codes == [0, 2], (tmp_path / "ok.log").read_text()[-3000:]
    log = (tmp_path / "ok.log").read_text()
    assert "SFT:" in log and "the chat template of" in log
    rows = int(re.search(r"SFT: [\d,]+ conversations in ([\d,]+) rows", log).group(1).replace(",", ""))
    epochs = 1600 / rows  # the repeated set is noted, as a repeated validation split is
    assert (f"warning: SFT reads 1,600 rows (400 steps × 4) of a set of {rows:,} rows: {epochs:.1f} epochs, every "
            f"conversation about {epochs:.0f} times; add conversations or lower --train-iters to repeat them less") in log
    manifest = json.loads((data / "sft.json").read_text())
    assert manifest["conversations"]["train"] > 20 and (data / "tokenizer_config.json").is_file()
    records = read_metrics(run)
    assert [r["k"] for r in records] == [3, 3, 3, 3]
    assert all(np.isfinite(r["valid_loss_fused3"]) for r in records[-1:])
    assert (tmp_path / "bad.err").read_text().strip().splitlines() == [
        f"error: {bad}:2: message 1 (user) has empty or missing content; {chat.SKIP_HINT}"]
    assert not (tmp_path / "bad").exists()

    # talking to it: the export carries the chat template; apply_chat_template gives training's
    # tokens, and generate --chat (the run) answers as the export's generate does (default mode: soft)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fbt_megatron.data.sft.tiny_set import set_files
    from fbt_megatron.inference.convert.to_hf import export

    hf = export(str(run), str(tmp_path / "hf"), say=lambda _: None)
    assert json.loads((hf / "tokenizer_config.json").read_text())["chat_template"] == chat.DEFAULT_CHAT_TEMPLATE
    question = "What does json.loads do?"
    messages = [{"role": "system", "content": "You answer questions."}, {"role": "user", "content": question}]
    tokenizer_file = set_files(data)[2]
    encoder = chat.ChatEncoder(load_tokenizer(tokenizer_file), *chat.chat_template(tokenizer_file))
    prompt = AutoTokenizer.from_pretrained(str(hf), trust_remote_code=True).apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False)
    assert prompt == encoder.tokens(encoder.render(messages, add_generation_prompt=True))
    longer = [*CONVERSATION, {"role": "user", "content": question}]  # an earlier assistant turn ends with EOD
    tokenizer = AutoTokenizer.from_pretrained(str(hf), trust_remote_code=True)
    ids = tokenizer.apply_chat_template(longer, add_generation_prompt=True, return_dict=False)
    assert ids == encoder.tokens(encoder.render(longer, add_generation_prompt=True)) and ids.count(encoder.tokenizer.eod) == 2
    assert tokenizer("a </s> b").input_ids == encoder.tokenizer.tokenize("a </s> b")  # plain text reads no specials
    model = AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        reply = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    reply = reply[:-1] if reply[-1] == encoder.tokenizer.eod else reply
    assert run_commands("fbt_megatron.generate", [(
        ["--load", run, "--chat", "--system", "You answer questions.", "--prompt", question, "--max-new-tokens", 8,
         "--print-ids", "--threads", 1], tmp_path / "chat.out", None)]) == [0]
    printed = (tmp_path / "chat.out").read_text().splitlines()
    assert "# mode soft: 1 prefill pass; greedy" in printed and printed[-1] == " ".join(map(str, prompt + reply))
