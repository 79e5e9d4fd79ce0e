"""Full-Bandwidth Transformer: latent feedback fusion and the k-pass training step.

Pass 1 is the standard forward. Pass j > 1 feeds back pass j−1's top states s^{(j−1)}:

    u_t = RMSNorm_fb( W_U (s^{(j−1)}_{t−1} + ε_t) ⊙ sigmoid(W_G e_t) )        (paper eq. F4)

for positions t ≥ 2 beyond the sequence's prefix-mixin length p, and u_t = e_t elsewhere;
ε ~ N(0, σ²) is the jitter on the carried state (training only). Every pass runs the whole
stack on all positions in parallel and gets its own next-token loss; gradients flow through
all passes. Positions are 1-based in comments and 0-based in code.

Packed rows (SFT, ``data.packed_rows.PackedRows``): several conversations share a row; each attends
only to itself, and its first position takes e_t like position 1 of a sequence, so no state
crosses a boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Union

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from fbt_megatron.common import seeds
from fbt_megatron.model.offload import recomputed_pass
from fbt_megatron.model.sequence import WHOLE_SEQUENCE, SequenceLayout, sequence_layout

if TYPE_CHECKING:
    from fbt_megatron.data.packed_rows import PackedRows


@dataclass
class Feedback:
    """What a fused pass receives from the previous one (rows as this rank holds them)."""

    state: torch.Tensor  # s^{(j−1)} [s, b, h], not yet shifted
    fuse_mask: torch.Tensor  # [s, b] bool: True where u_t replaces e_t (t ≥ 2 and t > p)
    jitter: Optional[torch.Tensor] = None  # ε [s, b, h] on the carried state, or None
    layout: SequenceLayout = WHOLE_SEQUENCE  # which positions the rows are (SP/CP shards)
    shifted: bool = False  # state is already s_{t−1} at row t (decoding one position at a time)


@dataclass
class LatentFeedbackFusionSubmodules:
    norm: Union[ModuleSpec, type]


class LatentFeedbackFusion(MegatronModule):
    """The GLU fusion: the carried state is the value, the token only gates (2·D² + D params)."""

    def __init__(self, config, submodules: LatentFeedbackFusionSubmodules):
        super().__init__(config)
        d = config.hidden_size
        self.linear_state = torch.nn.Linear(d, d, bias=False, dtype=config.params_dtype)  # W_U
        self.linear_gate = torch.nn.Linear(d, d, bias=False, dtype=config.params_dtype)  # W_G
        self.norm = build_module(submodules.norm, config=config, hidden_size=d, eps=config.layernorm_epsilon)
        for weight in (self.linear_state.weight, self.linear_gate.weight):
            if config.perform_initialization:
                config.init_method(weight)
            setattr(weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, embeddings: torch.Tensor, feedback: Feedback) -> torch.Tensor:
        carried = feedback.state if feedback.shifted else feedback.layout.shift(feedback.state)  # s_{t−1} at t
        if feedback.jitter is not None:
            carried = carried + feedback.jitter  # s_{t−1} + ε
        fused = self.norm(self.linear_state(carried) * torch.sigmoid(self.linear_gate(embeddings)))  # eq. F4
        return torch.where(feedback.fuse_mask.unsqueeze(-1), fused, embeddings)

    def keep_in_graph(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Pass 1 does not use the fusion; adding 0·ΣW gives its weights a (zero) gradient in
        every step, as overlapped gradient reduction needs every parameter to report one."""
        return embeddings + 0.0 * sum(p.sum() for p in self.parameters())


# ---------------------------------------------------------------- per-sequence random draws
# Prefix lengths and jitter are drawn from generators seeded by (sequence seed, pass, stream)
# (``seeds``): they depend on which sequence is drawn for, never on how the batch is split across
# ranks or microbatches, and a recomputed pass sees the same numbers.


def prefix_lengths(config, sequence_seeds: List[int], pass_index: int, seq_len: int) -> torch.Tensor:
    """Prefix mixin: per sequence, with probability q, p ~ U{0, …, ⌊f·T⌋−1}; else p = 0."""
    high = max(1, int(config.prefix_mixin_max_fraction * seq_len))
    lengths = []
    for seed in sequence_seeds:
        g = seeds.generator(seed, pass_index, seeds.PREFIX, "cpu")
        use = torch.rand((), generator=g).item() < config.prefix_mixin_prob
        p = torch.randint(0, high, (), generator=g).item()
        lengths.append(p if use else 0)
    return torch.tensor(lengths, dtype=torch.long)


def fuse_mask(prefix: torch.Tensor, seq_len: int, device) -> torch.Tensor:
    """[s, b] bool, True at 1-based positions t ≥ 2 with t > p (made on ``device``: only the b
    prefix lengths, drawn on the host, are copied)."""
    positions = torch.arange(seq_len, device=device).unsqueeze(1)  # 0-based index = t − 1
    return positions >= prefix.clamp(min=1).to(device).unsqueeze(0)


def jitter(config, sequence_seeds: List[int], pass_index: int, shape, device, dtype) -> torch.Tensor:
    """ε ~ N(0, σ²) of shape [s, b, h], one generator per sequence."""
    seq_len, _, hidden = shape
    noise = [
        torch.randn(seq_len, hidden, generator=seeds.generator(seed, pass_index, seeds.JITTER, device), device=device)
        for seed in sequence_seeds
    ]
    return (config.feedback_jitter * torch.stack(noise, dim=1)).to(dtype)


def make_feedback(
    config, state: torch.Tensor, sequence_seeds: List[int], pass_index: int, training: bool,
    layout: SequenceLayout = WHOLE_SEQUENCE, packed: Optional[PackedRows] = None,
) -> Feedback:
    """Feedback for pass `pass_index` (≥ 2) from the previous pass's top states. The draws are
    made over whole sequences, then cut to the rows this rank holds (``layout``). In packed rows
    the fusion also stops at conversation starts (and prompts: ``PackedRows.fusable``)."""
    seq_len = layout.seq_length or state.shape[0]
    batch = len(sequence_seeds)
    random_prefix = training and (packed is None or not packed.uses_prompt(training))
    prefix = prefix_lengths(config, sequence_seeds, pass_index, seq_len) if random_prefix else torch.zeros(batch, dtype=torch.long)
    eps = None
    if training and config.feedback_jitter > 0:
        shape = (seq_len, batch, state.shape[-1])
        eps = layout.local(jitter(config, sequence_seeds, pass_index, shape, state.device, state.dtype))
    mask = fuse_mask(prefix, seq_len, state.device)
    if packed is not None:
        mask = mask & packed.fusable(training).to(state.device)
    return Feedback(state, layout.local(mask), eps, layout)


# ---------------------------------------------------------------- the multi-pass step
@dataclass
class MultiPassOutput:
    loss: torch.Tensor  # Σ_j w_j L_j, differentiable
    pass_losses: List[torch.Tensor]  # L_j, detached
    state_delta_squares: List[torch.Tensor]  # mean over tokens of (s^{(j)} − s^{(j−1)})², j = 2..k, detached
    top_state: torch.Tensor  # s^{(k)}


def pass_weights(config, num_passes: int) -> List[float]:
    if config.pass_weights is None:
        return [1.0 / num_passes] * num_passes
    if len(config.pass_weights) < num_passes:
        raise ValueError(f"pass_weights has {len(config.pass_weights)} entries but {num_passes} passes were asked for")
    return list(config.pass_weights[:num_passes])


def masked_mean(token_loss: torch.Tensor, loss_mask: torch.Tensor, num_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Σ loss·mask / number of loss tokens. ``num_tokens`` is that number over whole sequences when
    they are split over context-parallel ranks: each rank's value is then its share of the mean."""
    loss_mask = loss_mask.to(token_loss.dtype)
    count = loss_mask.sum() if num_tokens is None else num_tokens.to(token_loss.dtype)
    return (token_loss * loss_mask).sum() / count.clamp(min=1)


def default_feedback(
    model, tokens: torch.Tensor, sequence_seeds: List[int], packed: Optional[PackedRows] = None,
) -> Callable[[torch.Tensor, int], Feedback]:
    """The production draws for a microbatch: prefix mixin and jitter from the sequence seeds,
    cut to this rank's rows of the sequence (SP/CP); in packed rows, within each conversation."""
    config = model.config
    layout = sequence_layout(config, tokens.shape[1] * config.context_parallel_size)
    return lambda state, j: make_feedback(config, state, sequence_seeds, j, model.training, layout, packed)


def run_pass(
    model, tokens, labels, pass_index: int, previous: Optional[torch.Tensor], feedback_fn, backward_next: bool = False,
    packed: Optional[PackedRows] = None,
):
    """Pass j of one microbatch → ``FBTModel.forward``'s (output, top state): the embeddings e_t,
    fused by eq. F4 with the previous pass's top states s^{(j−1)} (``previous``; None in pass 1).
    With ``recompute_passes`` the pass is recomputed in backward unless ``backward_next``
    (``offload.recomputed_pass``); a later pipeline stage runs ``distributed.pipeline.stage_pass``.
    ``packed``: the rows hold packed conversations, each attending only to itself."""
    embeddings = model.embed(tokens)  # e_t
    attention_mask = None if packed is None else packed.attention_mask

    def forward(embeddings, labels, previous):
        feedback = None if previous is None else feedback_fn(previous, pass_index)
        return model(tokens, labels=labels, feedback=feedback, embeddings=embeddings, attention_mask=attention_mask)

    return recomputed_pass(model.config, forward, embeddings, labels, previous, backward_next)


def state_delta_square(top: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Mean over this rank's tokens of (s^{(j)} − s^{(j−1)})² (a detached diagnostic). Its root,
    ‖Δs‖ (the RMS), is taken after averaging over microbatches and ranks: every shard of a
    sequence holds as many tokens, so the mean of the shards' means is the whole mean."""
    return (top.detach() - previous.detach()).float().pow(2).mean()


def multi_pass_loss(
    model,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    num_passes: int,
    sequence_seeds: List[int],
    feedback_fn: Optional[Callable[[torch.Tensor, int], Feedback]] = None,
    num_tokens: Optional[torch.Tensor] = None,
    packed: Optional[PackedRows] = None,
) -> MultiPassOutput:
    """k passes of teacher-forced training on one microbatch ([b, s] tokens/labels/mask), the
    whole model on this rank (no pipeline; ``distributed.pipeline`` runs passes across stages).
    The caller runs backward right after: pass k is never recomputed (``run_pass``'s ``backward_next``).

    `sequence_seeds` (one int per sequence) seed its prefix-mixin and jitter draws;
    `feedback_fn(state, j)` may replace those draws (tests pass fixed prefixes/noise);
    `num_tokens`: see ``masked_mean``; `packed`: the rows' packed conversations (``PackedRows``)."""
    if num_passes < 1:
        raise ValueError(f"num_passes must be >= 1, got {num_passes}")
    feedback_fn = feedback_fn or default_feedback(model, tokens, sequence_seeds, packed)
    weights = pass_weights(model.config, num_passes)
    total, losses, deltas, prev = 0.0, [], [], None
    for j in range(1, num_passes + 1):
        token_loss, top = run_pass(model, tokens, labels, j, prev, feedback_fn, backward_next=j == num_passes, packed=packed)
        loss_j = masked_mean(token_loss, loss_mask, num_tokens)
        total = total + weights[j - 1] * loss_j
        losses.append(loss_j.detach())
        if prev is not None:
            deltas.append(state_delta_square(top, prev))
        prev = top.detach() if model.config.detach_feedback else top
    return MultiPassOutput(loss=total, pass_losses=losses, state_delta_squares=deltas, top_state=prev)
