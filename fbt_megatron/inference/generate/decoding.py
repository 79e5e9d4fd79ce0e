"""Decoding an FBT model on one process, with megatron-core's static-batching KV cache.

Modes (positions 0-based; s_t is the top state of position t, ``config.feedback_state``):

    standard   the plain model: one pass, no fusion
    soft       the prompt runs as a plain pass; every generated position t takes
               u_t = fuse(s_{t−1}, e_t) — the k-pass forward with prefix p = len(prompt) and
               k = T − p + 1 passes on the whole sequence of length T
    fused(n)   n extra fused passes over the prompt (pass j ≥ 2 takes fuse(s^{(j−1)}_{t−1}, e_t) at
               t ≥ 1), the KV cache is the last pass's, then soft decoding from s^{(n+1)}_{p−1};
               fused(0) = soft
    adaptive   fused passes until RMS(s^{(j)} − s^{(j−1)}) over the prompt's positions is below
               ``tolerance`` or ``max_passes`` passes ran, then soft decoding. In a batch the pass
               count is decided once, over the positions every prompt has (the shortest prompt's
               length): a sequence may get another count alone than in a batch

The batch shares one position (megatron's static batching): the shortest prompt's length is
prefilled for the whole batch, all passes in parallel over it, then one position at a time; a
sequence still inside its prompt takes its prompt token and prompt inputs (pass 1: e_t, pass j:
fuse(s^{(j−1)}_{t−1}, e_t)), the others their sampled token with the soft input. Fused passes over
prompts of different lengths keep one KV cache per pass until every prompt is consumed. Caches
hold keys with RoPE applied; sliding-window layers keep only their last W − 1 positions
(``layers.FBTSelfAttention``).

``use_cache=False`` recomputes the whole sequence at every position from the same inputs (the
prompt inputs of the last prefill pass, run over the padded prompts; the soft inputs from the
states kept so far): the reference the cache is tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from fbt_megatron.common.errors import ArgumentError
from fbt_megatron.model import decode_modes
from fbt_megatron.model.fbt import Feedback, fuse_mask

MODES = (*decode_modes.MODES, "adaptive")


@dataclass
class Generation:
    tokens: List[List[int]]  # generated tokens per sequence (the stop token included if hit)
    logits: Optional[List[torch.Tensor]]  # per sequence [n_generated, V] fp32 (return_logits=True)
    prefill_passes: int  # passes run over the prompt: 1 standard/soft, n + 1 fused(n), adaptive's count


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    mode: Optional[str] = None,
    fused_passes: int = 0,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_tokens: Sequence[int] = (),
    seed: int = 0,
    tolerance: float = 1e-3,
    max_passes: int = 8,
    use_cache: bool = True,
    return_logits: bool = False,
    max_length: Optional[int] = None,
    vocab_size: Optional[int] = None,
    on_token: Optional[Callable[[int, int], None]] = None,
) -> Generation:
    """Up to ``max_new_tokens`` tokens after each prompt (token ids; lengths may differ), in ``mode``
    (module docstring; ``fused_passes`` is fused's n, ``tolerance`` and ``max_passes`` adaptive's;
    None: soft with latent feedback, standard for a baseline, ``decode_modes.default_mode``).
    Greedy when ``temperature`` is 0, else sampled at that temperature from the smallest set of
    tokens whose probability reaches ``top_p``; sequence i draws from a generator seeded with
    ``seed + i``. A token in ``stop_tokens`` ends its sequence. ``max_length`` (default the model's
    ``seq_length``; RoPE itself goes further) bounds prompt + generation; ``vocab_size`` restricts
    the choice to the first ids (the tokenizer's, the embedding being padded). ``on_token(i, token)``
    is called as each token of sequence i is chosen (streaming; a decode time measured inside one
    generation)."""
    if max_new_tokens < 1:
        raise ArgumentError(f"{{max_new_tokens}} must be >= 1, got {max_new_tokens}", "max_new_tokens")
    if temperature < 0 or not math.isfinite(temperature):
        raise ArgumentError(f"{{temperature}} must be >= 0 (0: greedy), got {temperature}", "temperature")
    if not 0.0 < top_p <= 1.0:
        raise ArgumentError(f"{{top_p}} must be in (0, 1], got {top_p}", "top_p")
    prompts = _check_prompts(model, prompts, [max_new_tokens] * len(prompts), max_length, "generation")
    stops = set(int(x) for x in stop_tokens)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]
    out: List[List[int]] = [[] for _ in prompts]

    def choose(i: int, logits: torch.Tensor) -> Optional[int]:
        """The next token of sequence i from its logits [V], or None when it is finished."""
        if vocab_size is not None:
            logits = logits[:vocab_size]
        token = _sample(logits, temperature, top_p, generators[i])
        out[i].append(token)
        if on_token is not None:
            on_token(i, token)
        return None if token in stops or len(out[i]) == max_new_tokens else token

    passes, logits = _decode(model, prompts, [max_new_tokens] * len(prompts), choose, mode, fused_passes,
                             tolerance, max_passes, use_cache, return_logits)
    return Generation(out, logits, passes)


def forced_logits(
    model,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    mode: Optional[str] = None,
    fused_passes: int = 0,
    tolerance: float = 1e-3,
    max_passes: int = 8,
    use_cache: bool = True,
    max_length: Optional[int] = None,
) -> List[torch.Tensor]:
    """Teacher-forced decoding: the continuation tokens are fed instead of sampled ones, in the
    mode's way (soft: fused inputs over the continuation). Per sequence, logits [len(continuation)
    + 1, V] fp32: the prediction after the prompt's last token, then after each continuation token."""
    if len(continuations) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
    continuations = [[int(x) for x in c] for c in continuations]
    if any(x < 0 or x >= model.config.vocab_size for c in continuations for x in c):
        raise ValueError(f"a continuation holds a token id outside the model's vocabulary "
                         f"[0, {model.config.vocab_size})")
    prompts = _check_prompts(model, prompts, [len(c) for c in continuations], max_length, "prompt + continuation")
    done = [0] * len(prompts)

    def choose(i: int, _logits: torch.Tensor) -> Optional[int]:
        done[i] += 1
        return continuations[i][done[i] - 1] if done[i] <= len(continuations[i]) else None

    _, logits = _decode(model, prompts, [len(c) + 1 for c in continuations], choose, mode, fused_passes,
                        tolerance, max_passes, use_cache, True)
    return logits


# ---------------------------------------------------------------- checks and sampling
def _check_prompts(model, prompts, extra: List[int], max_length: Optional[int], what: str) -> List[List[int]]:
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    prompts = [[int(x) for x in p] for p in prompts]
    limit = model.config.seq_length if max_length is None else max_length
    vocab = model.config.vocab_size
    for i, (p, n) in enumerate(zip(prompts, extra)):
        if not p:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompt {i} holds a token id outside the model's vocabulary [0, {vocab})")
        if len(p) + n > limit:
            raise ArgumentError(f"prompt {i}: {what} of {len(p)} + {n} tokens is longer than the maximum length "
                                f"{limit} (the model's seq_length; {{max_length}} goes beyond it)", "max_length")
    return prompts


def _sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
        keep = before < top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def _pass_count(model, mode: str, fused_passes: int, tolerance: float, max_passes: int) -> Optional[int]:
    """The number of prefill passes, None for adaptive (decided while prefilling)."""
    if mode not in MODES:
        raise ArgumentError(f"{{mode}} {mode}: unknown mode; choose one of {', '.join(MODES)}", "mode")
    if mode != "standard" and not model.config.latent_feedback:
        raise ArgumentError(f"{{mode}} {mode} needs latent feedback, and this model has none (latent_feedback false): "
                            "use {mode} standard", "mode")
    if fused_passes < 0:
        raise ArgumentError(f"{{fused_passes}} must be >= 0, got {fused_passes}", "fused_passes")
    if mode == "adaptive":
        if max_passes < 1:
            raise ArgumentError(f"{{max_passes}} must be >= 1, got {max_passes}", "max_passes")
        if not tolerance > 0:
            raise ArgumentError(f"{{tolerance}} must be > 0, got {tolerance}", "tolerance")
        return None
    return fused_passes + 1 if mode == "fused" else 1


# ---------------------------------------------------------------- the decoding loop
def _decode(model, prompts, outputs: List[int], choose: Callable, mode, fused_passes, tolerance, max_passes,
            use_cache: bool, keep_logits: bool) -> tuple:
    """Runs the batch. Sequence i yields logits at positions len(prompt_i) − 1 … + outputs[i] − 1;
    after each, ``choose(i, logits)`` names the token fed at the next position (None: finished).
    Returns (prefill passes, per-sequence logits [n, V] fp32 on the CPU, or None)."""
    if mode is None:
        mode = "fused" if fused_passes else decode_modes.default_mode(model.config.latent_feedback)
    num_passes = _pass_count(model, mode, fused_passes, tolerance, max_passes)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            decoder = _Decoder(model, prompts, outputs, mode, num_passes, tolerance, max_passes, use_cache)
            return decoder.run(choose, keep_logits)
    finally:
        model.train(was_training)


class _Decoder:
    def __init__(self, model, prompts, outputs, mode, num_passes, tolerance, max_passes, use_cache):
        self.model, self.mode, self.use_cache = model, mode, use_cache
        self.num_passes, self.tolerance, self.max_passes = num_passes, tolerance, max_passes
        b = len(prompts)
        self.prompt_lengths = torch.tensor([len(p) for p in prompts])
        self.starts = [len(p) - 1 for p in prompts]  # the first position whose logits are kept
        self.ends = [len(p) + n - 1 for p, n in zip(prompts, outputs)]  # positions fed: 0 … end − 1
        self.length = max(self.ends)  # T: positions the batch runs
        self.tokens = torch.zeros(b, self.length, dtype=torch.long)
        for i, p in enumerate(prompts):
            self.tokens[i, : len(p)] = torch.tensor(p)
        self.tokens = self.tokens.to(next(model.parameters()).device)

    # -- model calls
    def _context(self):
        return StaticInferenceContext(self.tokens.shape[0], self.length) if self.use_cache else None

    def _run(self, ids, inputs, context=None):
        """(logits [b, V] of the last position fp32, top states [s, b, h]); moves the cache on."""
        logits, top = self.model(ids, embeddings=inputs, inference_context=context)
        if context is not None:
            context.increment_sequence_len_offset(ids.shape[1])
        return logits[:, -1].float().cpu(), top

    def _fuse(self, carried, embeddings, mask, shifted=True):
        return self.model.feedback_fusion(embeddings, Feedback(carried, mask, shifted=shifted))

    # -- prefill: every pass over the positions all prompts have (cached) or over the padded prompts
    def _prefill(self, span: int):
        """Passes over positions [0, span); the pass count from the mode or, adaptive, from the
        positions [0, shortest prompt). Returns (last pass's logits at span − 1, per-pass top
        states [span, b, h], the last pass's inputs, per-pass contexts)."""
        ids = self.tokens[:, :span]
        embeddings = self.model.embed(ids)
        common = int(self.prompt_lengths.min())
        ragged = common < int(self.prompt_lengths.max())
        mask = fuse_mask(torch.zeros(ids.shape[0], dtype=torch.long), span, embeddings.device)  # t ≥ 1
        fixed = self.num_passes
        states, contexts, inputs = [], [], embeddings
        j = 0
        while True:
            j += 1
            if j > 1:
                inputs = self._fuse(states[-1], embeddings, mask, shifted=False)
            # a cache per pass for ragged prompts; else only the last pass's (adaptive: the latest)
            keep = self.use_cache and (ragged or fixed is None or j == fixed)
            context = self._context() if keep else None
            logits, top = self._run(ids, inputs, context)
            if context is not None and not ragged and contexts:
                contexts[-1] = None  # equal prompts: the previous pass's cache is never read
            states.append(top)
            contexts.append(context)
            if fixed is not None:
                if j == fixed:
                    break
            elif j >= self.max_passes or (j > 1 and _rms(states[-1][:common] - states[-2][:common]) < self.tolerance):
                break
        return logits, states, inputs, contexts

    def run(self, choose, keep_logits: bool):
        b = self.tokens.shape[0]
        common = int(self.prompt_lengths.min())
        standard = self.mode == "standard"
        logits_out: List[List[torch.Tensor]] = [[] for _ in range(b)]
        finished = [False] * b

        if self.use_cache:
            logits, states, _, contexts = self._prefill(common)
            previous = [s[-1] for s in states]  # s^{(j)}_{t−1} per pass, [b, h]
        else:
            span = int(self.prompt_lengths.max())
            _, states, prompt_inputs, _ = self._prefill(span)
            inputs = torch.zeros(self.length, b, prompt_inputs.shape[-1], dtype=prompt_inputs.dtype,
                                 device=prompt_inputs.device)
            inputs[:span] = prompt_inputs
            logits, top = self._run(self.tokens[:, :common], inputs[:common])
            kept = top[-1]  # the state of the last position run, [b, h]
        num_passes = len(states)

        t = common - 1
        while True:
            # the logits at position t: record, and name the token at t + 1
            for i in range(b):
                if finished[i] or t < self.starts[i]:
                    continue
                if keep_logits:
                    logits_out[i].append(logits[i].clone())
                token = choose(i, logits[i])
                if token is None or t + 1 >= self.ends[i]:
                    finished[i] = True
                elif t + 1 > self.starts[i]:
                    self.tokens[i, t + 1] = token
            if all(finished):
                break
            t += 1
            ids = self.tokens[:, t : t + 1]
            embeddings = self.model.embed(ids)  # [1, b, h]
            in_prompt = (self.prompt_lengths > t).to(ids.device)  # [b]
            soft = ~in_prompt.unsqueeze(0)  # [1, b]: the fuse decision, t ≥ the sequence's prompt length
            if not self.use_cache:
                if not standard:
                    fused = self._fuse(kept.unsqueeze(0), embeddings, soft)
                    inputs[t] = torch.where(soft.unsqueeze(-1), fused, inputs[t])[0]
                else:
                    inputs[t] = embeddings[0]
                logits, top = self._run(self.tokens[:, : t + 1], inputs[: t + 1])
                kept = top[-1]
            elif standard:
                logits, _ = self._run(ids, embeddings, contexts[-1])
            elif num_passes > 1 and bool(in_prompt.any()):
                # some prompt goes on: pass j on cache j, fuse(s^{(j−1)}_{t−1}, e_t) for prompt rows;
                # generating rows read the last cache only, with their soft input
                tops = []
                for j in range(1, num_passes + 1):
                    carried = previous[-1]
                    if j > 1:
                        carried = torch.where(in_prompt.unsqueeze(-1), previous[j - 2], carried)
                    mask = soft | (j > 1)
                    logits, top = self._run(ids, self._fuse(carried.unsqueeze(0), embeddings, mask), contexts[j - 1])
                    tops.append(top[-1])
                previous = tops
            else:
                if num_passes > 1 and contexts[0] is not None:
                    contexts[:-1] = [None] * (num_passes - 1)  # every prompt is consumed
                logits, top = self._run(ids, self._fuse(previous[-1].unsqueeze(0), embeddings, soft), contexts[-1])
                previous[-1] = top[-1]
        return num_passes, [torch.stack(x) for x in logits_out] if keep_logits else None


def _rms(delta: torch.Tensor) -> float:
    """Root of the mean square over positions, sequences and hidden units."""
    return float(delta.float().pow(2).mean().sqrt())
