"""Supervised fine-tuning data: chat JSONL → packed training rows.

**Records**: one conversation per line, ``{"messages": [{"role": "system"|"user"|"assistant",
"content": "..."}, ...]}``. A bad record — invalid JSON, no ``messages`` list, a missing or unknown
role, empty content, no assistant turn, a conversation longer than the sequence, one the template
refuses — stops the run with one line naming the file and line and the fix; with
``--sft-skip-bad-records`` it is skipped, and the skips are counted per kind in one line per file.
Nothing is written while reading.

**Chat template** (stored with the tokenizer): a Jinja template in Hugging Face's form, the
``chat_template`` of a ``tokenizer_config.json`` beside the tokenizer file (a user's tokenizer folder
brings its own), else ``DEFAULT_CHAT_TEMPLATE``. It is rendered by transformers' own
``render_jinja_template`` (``apply_chat_template``'s: jinja2's immutable sandbox); the variables ``messages``, ``add_generation_prompt``, ``eos_token`` (the tokenizer's end of document,
which ends an assistant turn) and ``bos_token``. A prepared SFT set stores its tokenizer with a
``tokenizer_config.json`` holding the template.

**Assistant spans**: rendered prefix by prefix. Message i adds render(messages[:i+1]) minus
render(messages[:i]) (an error if the template does not extend its own prefix); an assistant message's
span starts after render(messages[:i], add_generation_prompt=True), so its role header is prompt and
the span is what a model generates after that prompt: the content and the end of turn (EOD). Each
piece is tokenised alone (``eos_token`` → the EOD id), so span boundaries are token boundaries.

**Rows**: a conversation of n tokens gives n − 1 positions (input token, label). Conversations are
packed whole (never split) into rows of ``seq_length`` positions, best fit in a seeded random order,
padding at the end; rows are read in a seeded permutation per epoch. Per position: ``tokens``,
``labels``, ``loss_mask`` (1 where the label is an assistant token, its end of turn included; 0 on
system and user turns, role headers and padding), ``segments`` (which conversation; the padding is
one of its own) and ``plain`` (the input token is not the assistant's). No label crosses a boundary:
a conversation's last token is only a label.

**Attention and positions** (``fbt.PackedRows``): each conversation attends only to itself through an
explicit mask (later position or other conversation → masked) with megatron-core's local attention;
sliding-window layers keep their window (``layers.FBTDotProductAttention``). On GPUs the same mask
works with the local spec; Transformer Engine's route would be megatron-core's packed-sequence path
(``PackedSeqParams`` / ``cu_seqlens``, THD), not wired here (TE attention with packed rows is refused).
RoPE positions are not reset per conversation (Megatron's ``reset_position_ids`` off): RoPE scores
depend only on the distance between positions, so a conversation's attention does not depend on its
offset; tests/test_sft.py checks that a packed row's per-token losses equal each conversation's alone
(to float rounding).

**Prefix mixin** (``data.sft_prefix_mixin``). ``prompt`` (default): in fused passes every position whose
input is not an assistant token keeps its plain embedding — the prompt (system, first user turn and
the assistant header) and also later user turns; assistant tokens are fused. ``fbt_megatron.generate``
runs any prompt with plain embeddings and fuses only the tokens it generates, and continuing a
conversation means giving it the follow-up user turn as (part of) a prompt: so user turns are plain
and replies fused at every turn. (A follow-up re-prompted from scratch would run the earlier replies
plain too; in training they stay fused, as they were when generated.) A conversation's first position
is never fused either way. ``random``: the pretraining random prefix per row. Validation uses the
prompt in both cases (prompt-then-generate), so the two are measured alike.

**The tiny set** (``data.corpus: sft:stdlib`` or ``sft:FOLDER`` of ``.py`` files): questions about the
public functions and classes of Python's standard library answered with the first paragraph of their
docstrings (and, for some, a follow-up about their parameters), split by module like the corpus,
written to a folder built beside ``data.data_path`` and renamed when complete.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from jinja2 import TemplateError, TemplateSyntaxError

from fbt_megatron.data.tokenizer import Tokenizer, load_tokenizer

ROLES = ("system", "user", "assistant")
TOKENIZER_CONFIG = "tokenizer_config.json"
MANIFEST = "sft.json"
SOURCE_PREFIX = "sft:"
SPLITS = ("train", "valid")
SKIP_HINT = "fix or remove the record, or add --sft-skip-bad-records to skip (and count) bad records"

# role headers as plain text (a small code tokenizer has no special tokens for them); an assistant
# turn ends with the tokenizer's end of document
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + '\\n' + message['content'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}"
)


# ---------------------------------------------------------------- the chat template
def chat_template(tokenizer_path: str) -> Tuple[str, str]:
    """(template, where it came from): the ``chat_template`` of the tokenizer_config.json beside
    the tokenizer file, else the default."""
    config = Path(tokenizer_path).parent / TOKENIZER_CONFIG
    if not config.is_file():
        return DEFAULT_CHAT_TEMPLATE, "the default chat template"
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{config} is not a readable JSON object ({e}); fix it or remove it for the default chat template") from None
    if template is None:
        return DEFAULT_CHAT_TEMPLATE, "the default chat template"
    if not isinstance(template, str):  # HF's list of named templates: the "default" one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if not isinstance(template, str):
            raise ValueError(f"{config}: chat_template has no 'default' template")
    return template, f"the chat template of {config}"


def write_tokenizer_config(folder: str, tokenizer: Tokenizer) -> None:
    """A tokenizer_config.json holding the default chat template, beside the tokenizer."""
    config = {"chat_template": DEFAULT_CHAT_TEMPLATE, "eos_token": _piece(tokenizer, tokenizer.eod)}
    Path(folder, TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _piece(tokenizer: Tokenizer, token: int) -> str:
    piece = tokenizer.inv_vocab[token]
    return piece.decode() if isinstance(piece, bytes) else piece


class BadRecord(Exception):
    """A record that cannot be trained on: ``kind`` (counted when skipping) and what is wrong."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind



class ChatEncoder:
    """Conversations → (token ids, is-assistant per token) with a chat template (module docstring),
    rendered by transformers' ``render_jinja_template`` (what ``apply_chat_template`` runs)."""

    def __init__(self, tokenizer: Tokenizer, template: str, source: str):
        self.tokenizer, self.template, self.source = tokenizer, template, source
        self.eos = _piece(tokenizer, tokenizer.eod)
        try:
            self.render([])
        except TemplateSyntaxError as e:
            raise ValueError(f"{source} is not a valid Jinja template ({e})") from None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template  # only SFT runs pay its import

        try:
            [text], _ = render_jinja_template(conversations=[list(messages)], chat_template=self.template,
                                              add_generation_prompt=add_generation_prompt, eos_token=self.eos, bos_token="")
        except TemplateSyntaxError:
            raise
        except TemplateError as e:
            raise BadRecord("refused by the chat template", f"the chat template refuses it ({e})") from None
        return text

    def tokens(self, text: str) -> List[int]:
        """``text`` tokenised, each ``eos_token`` in it the EOD id."""
        ids: List[int] = []
        for i, part in enumerate(text.split(self.eos)):
            if i:
                ids.append(self.tokenizer.eod)
            if part:
                ids += self.tokenizer.tokenize(part)
        return ids

    def encode(self, messages: Sequence[dict]) -> Tuple[np.ndarray, np.ndarray]:
        """Token ids and, per token, whether the assistant generates it (content + end of turn)."""
        ids: List[int] = []
        assistant: List[bool] = []
        done = self.render([])
        for i, message in enumerate(messages):
            pieces = []
            if message["role"] == "assistant":
                prompt = self.render(messages[:i], add_generation_prompt=True)
                pieces.append((self._extension(done, prompt), False))  # the role header
                done = prompt
            full = self.render(messages[: i + 1])
            pieces.append((self._extension(done, full), message["role"] == "assistant"))
            done = full
            for text, is_assistant in pieces:
                piece = self.tokens(text)
                ids += piece
                assistant += [is_assistant] * len(piece)
        return np.asarray(ids, dtype=np.int64), np.asarray(assistant, dtype=bool)

    def _extension(self, prefix: str, text: str) -> str:
        if not text.startswith(prefix):
            raise ValueError(f"{self.source} does not render conversations prefix by prefix (a longer conversation "
                             f"does not extend a shorter one's text), so assistant turns cannot be located; use "
                             f"a template whose turns are appended in order")
        return text[len(prefix):]


# ---------------------------------------------------------------- reading records
@dataclass
class Conversation:
    ids: np.ndarray  # [n] token ids
    assistant: np.ndarray  # [n] bool: generated by the assistant


def _messages(line: str) -> List[dict]:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise BadRecord("invalid JSON", f"invalid JSON ({e})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise BadRecord("no messages", 'no "messages" list (expected {"messages": [{"role": ..., "content": ...}, ...]})')
    for n, message in enumerate(messages, 1):
        if not isinstance(message, dict) or "role" not in message:
            raise BadRecord("missing role", f"message {n} has no role")
        if message["role"] not in ROLES:
            raise BadRecord("unknown role", f"message {n} has role {message['role']!r} (one of {', '.join(ROLES)})")
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            raise BadRecord("empty content", f"message {n} ({message['role']}) has empty or missing content")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no assistant turn", "no assistant turn (nothing to train on)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_conversations(path: str, encoder: ChatEncoder, seq_length: int, skip_bad: bool,
                       report: bool = True) -> List[Conversation]:
    """The conversations of one chat JSONL file that fit ``seq_length`` positions (module docstring
    for bad records; ``report``: print the skip counts)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SFT data file {path} does not exist")
    conversations, skipped = [], Counter()
    with open(path, encoding="utf-8", errors="strict") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids, assistant = encoder.encode(_messages(line))
                if len(ids) - 1 > seq_length:
                    raise BadRecord("longer than the sequence", f"the conversation is {len(ids)} tokens, longer than "
                                    f"the sequence ({seq_length} positions hold {seq_length + 1} tokens); "
                                    f"shorten it or raise --seq-length")
                conversations.append(Conversation(ids, assistant))
            except BadRecord as e:
                if not skip_bad:
                    raise ValueError(f"{path}:{number}: {e}; {SKIP_HINT}") from None
                skipped[e.kind] += 1
    if report and skipped:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(skipped.items()))
        print(f"sft: skipped {sum(skipped.values())} bad records of {path} ({kinds})", flush=True)
    if not conversations:
        raise ValueError(f"{path} holds no usable conversation")
    return conversations


# ---------------------------------------------------------------- packing
def pack(lengths: Sequence[int], capacity: int, seed: int) -> List[List[int]]:
    """Rows of conversation indices whose lengths sum to at most ``capacity``: each conversation, in
    a seeded random order, goes to the row it fills best (the least free space that holds it; ties:
    the oldest row), else starts a new row. Deterministic for (lengths, capacity, seed)."""
    rows: List[List[int]] = []
    by_free: List[List[int]] = [[] for _ in range(capacity + 1)]  # free positions → rows, oldest first
    for i in np.random.default_rng(seed).permutation(len(lengths)).tolist():
        need = lengths[i]
        free = next((f for f in range(need, capacity + 1) if by_free[f]), None)
        if free is None:
            rows.append([])
            row, free = len(rows) - 1, capacity
        else:
            row = by_free[free].pop(0)
        rows[row].append(i)
        bisect.insort(by_free[free - need], row)
    return rows


class SFTDataset:
    """Packed rows of conversations (module docstring), indexed like a GPTDataset: item i is a dict
    of numpy arrays of ``seq_length`` positions; beyond one epoch the rows repeat in another
    seeded order."""

    def __init__(self, conversations: List[Conversation], seq_length: int, seed: int, pad: int):
        self.conversations, self.seq_length, self.seed, self.pad = conversations, seq_length, seed, pad
        self.rows = pack([len(c.ids) - 1 for c in conversations], seq_length, seed)
        self._orders: Dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def tokens(self) -> int:
        """Positions holding a conversation (not padding) over one epoch."""
        return sum(len(c.ids) - 1 for c in self.conversations)

    def __getitem__(self, index: int) -> dict:
        epoch, i = divmod(int(index), len(self.rows))
        if epoch not in self._orders:
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        return self.row(self.rows[self._orders[epoch][i]])

    def row(self, members: Sequence[int]) -> dict:
        s = self.seq_length
        out = dict(tokens=np.full(s, self.pad, dtype=np.int64), labels=np.full(s, self.pad, dtype=np.int64),
                   loss_mask=np.zeros(s, dtype=np.float32), segments=np.full(s, len(members), dtype=np.int64),
                   plain=np.ones(s, dtype=bool))
        start = 0
        for segment, c in enumerate(self.conversations[m] for m in members):
            end = start + len(c.ids) - 1
            out["tokens"][start:end], out["labels"][start:end] = c.ids[:-1], c.ids[1:]
            out["loss_mask"][start:end] = c.assistant[1:]
            out["segments"][start:end] = segment
            out["plain"][start:end] = ~c.assistant[:-1]
            start = end
        return out


# ---------------------------------------------------------------- the run's SFT data
def _jsonl_files(spec, key: str) -> List[str]:
    if not all(isinstance(p, str) and p.endswith(".jsonl") for p in spec):
        raise ValueError(f"{key} must list chat .jsonl files with --sft (no blend weights), got {spec}")
    return list(spec)


def load_sft_data(d, seed: int, report: bool = True):
    """(tokenizer, train, valid, source) for the data section ``d`` with ``d.sft``: its
    train_data_path / valid_data_path chat JSONL files with ``d.tokenizer_model``, or the prepared
    SFT set in ``d.data_path`` with the tokenizer (and chat template) stored there."""
    if d.train_data_path is not None:
        train = _jsonl_files(d.train_data_path, "data.train_data_path")
        valid = _jsonl_files(d.valid_data_path, "data.valid_data_path") if d.valid_data_path else train
        tokenizer_path, source = d.tokenizer_model, " ".join(train)
    else:
        manifest = _manifest(d.data_path)
        if manifest is None:
            raise ValueError(f"data.data_path {d.data_path} is not a prepared SFT set (no {MANIFEST}): set --corpus "
                             f"sft:stdlib to prepare one there, or --train-data-path to chat .jsonl files")
        train, valid = ([str(Path(d.data_path, manifest["splits"][s]))] for s in SPLITS)
        tokenizer_path, source = str(Path(d.data_path, manifest["tokenizer"])), str(d.data_path)
    tokenizer = load_tokenizer(tokenizer_path)
    encoder = ChatEncoder(tokenizer, *chat_template(tokenizer_path))
    splits = []
    for paths, split_seed in ((train, seed), (valid, seed + 1)):
        conversations = [c for p in paths for c in read_conversations(p, encoder, d.seq_length, d.sft_skip_bad_records, report)]
        splits.append(SFTDataset(conversations, d.seq_length, split_seed, tokenizer.pad))
    described = (f"{source} (SFT: {len(splits[0].conversations):,} conversations in {len(splits[0]):,} rows, "
                 f"{splits[0].tokens / (len(splits[0]) * d.seq_length):.0%} filled; {encoder.source}; "
                 f"prefix mixin: {d.sft_prefix_mixin})")
    return tokenizer, splits[0], splits[1], described


# ---------------------------------------------------------------- the tiny set from the standard library
def set_source(corpus: Optional[str]) -> Optional[str]:
    """The source a ``data.corpus`` value names for an SFT set ("sft:stdlib", "sft:FOLDER"), else None."""
    return corpus[len(SOURCE_PREFIX):] if corpus and corpus.startswith(SOURCE_PREFIX) else None


SYSTEM = "You answer questions about Python's standard library from its source."


def _summary(docstring: Optional[str]) -> Optional[str]:
    """The first paragraph of a docstring on one line, if it is a sentence of reasonable length."""
    if not docstring:
        return None
    text = " ".join(docstring.strip().split("\n\n")[0].split())
    return text if 16 <= len(text) <= 160 and text[0].isalpha() else None


def _parameters(node: ast.FunctionDef) -> str:
    a = node.args
    names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs] if x.arg not in ("self", "cls")]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return ", ".join(names)


def module_conversations(module: str, text: str) -> Iterator[dict]:
    """Chat records about one module's public functions and classes (deterministic)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        answer = _summary(ast.get_docstring(node))
        if answer is None:
            continue
        name = f"{module}.{node.name}"
        h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")
        question = f"What does {name} do?" if isinstance(node, ast.FunctionDef) else f"What is {name}?"
        messages = ([{"role": "system", "content": SYSTEM}] if h % 3 == 0 else []) + [
            {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if isinstance(node, ast.FunctionDef) and h % 4 == 1:  # a second turn
            params = _parameters(node)
            messages += [{"role": "user", "content": "What are its parameters?"},
                         {"role": "assistant", "content": f"{node.name}({params})" if params else "It takes none."}]
        yield {"messages": messages}


def _manifest(folder) -> Optional[dict]:
    try:
        return json.loads(Path(folder, MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def ensure_sft_set(corpus: str, output: str, tokenizer_model: Optional[str], seq_length: int) -> None:
    """Prepare the tiny SFT set ``output`` from ``corpus`` ("sft:stdlib" or "sft:FOLDER") unless it
    is there already, made with the same settings: train.jsonl, valid.jsonl (conversations that fit
    ``seq_length`` positions), a copy of the tokenizer with a tokenizer_config.json (the chat
    template) and sft.json. Built in a temporary folder beside ``output``, renamed when complete."""
    from fbt_megatron.data.corpus import source_documents, split_documents

    source = set_source(corpus)
    if tokenizer_model is None:
        raise ValueError(f"--corpus {corpus} needs --tokenizer-model (the tokenizer of the run to fine-tune)")
    tokenizer = load_tokenizer(tokenizer_model)
    settings = {"source": source if source == "stdlib" else os.path.abspath(source), "tokenizer_sha256": tokenizer.sha256,
                "seq_length": seq_length}
    existing = _manifest(output)
    if existing is not None:
        if existing.get("settings") != settings:
            raise ValueError(f"--data-path {output} holds an SFT set prepared from other settings ({existing.get('settings')}); "
                             f"choose another --data-path or remove it")
        return
    if os.path.exists(output) and os.listdir(output):
        raise ValueError(f"--data-path {output} exists and is not an SFT set; choose another --data-path")
    if source != "stdlib" and not os.path.isdir(source):
        raise FileNotFoundError(f"--corpus {corpus}: {source} is not a folder of .py files (or use sft:stdlib)")
    documents = [d for d in source_documents(source) if d.name.endswith(".py")]
    in_valid = split_documents([d.name for d in documents], 0.1)
    encoder = ChatEncoder(tokenizer, DEFAULT_CHAT_TEMPLATE, "the default chat template")
    parent, name = os.path.split(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    os.chmod(tmp, 0o755)
    try:
        counts = {}
        for split, wanted in zip(SPLITS, (False, True)):
            with open(Path(tmp, f"{split}.jsonl"), "w", encoding="utf-8") as f:
                counts[split] = 0
                for doc, valid in zip(documents, in_valid):
                    if valid == wanted:
                        module = doc.name[:-3].replace(os.sep, ".").removesuffix(".__init__")
                        for record in module_conversations(module, doc.text):
                            if len(encoder.encode(record["messages"])[0]) - 1 > seq_length:
                                continue
                            f.write(json.dumps(record, ensure_ascii=False) + "\n")
                            counts[split] += 1
        tokenizer_file = os.path.basename(tokenizer_model)
        shutil.copyfile(tokenizer_model, Path(tmp, tokenizer_file))
        write_tokenizer_config(tmp, tokenizer)
        manifest = {"settings": settings, "tokenizer": tokenizer_file, "conversations": counts,
                    "splits": {s: f"{s}.jsonl" for s in SPLITS}}
        Path(tmp, MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if os.path.exists(output):
            os.rmdir(output)  # an empty folder
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
