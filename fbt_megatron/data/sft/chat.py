"""Chat records → token ids with the assistant's tokens marked, through a chat template.

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
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np
from jinja2 import TemplateError, TemplateSyntaxError

from fbt_megatron.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
TOKENIZER_CONFIG = "tokenizer_config.json"
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


def read_conversations(path: str, encoder: ChatEncoder, seq_length: int, skip_bad: bool) -> List[Conversation]:
    """The conversations of one chat JSONL file that fit ``seq_length`` positions (module docstring
    for bad records; the skip counts are logged)."""
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
    if skipped:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(skipped.items()))
        log.info(f"sft: skipped {sum(skipped.values())} bad records of {path} ({kinds})")
    if not conversations:
        raise ValueError(f"{path} holds no usable conversation")
    return conversations
