"""Full-Bandwidth Transformer: latent feedback fusion and the k-pass training step.

Pass 1 is the standard forward. Pass j > 1 feeds back pass j−1's top states s^{(j−1)}:

    u_t = RMSNorm_fb( W_U (s^{(j−1)}_{t−1} + ε_t) ⊙ sigmoid(W_G e_t) )        (paper eq. F4)

for positions t ≥ 2 beyond the sequence's prefix-mixin length p, and u_t = e_t elsewhere;
ε ~ N(0, σ²) is the jitter on the carried state (training only). Every pass runs the whole
stack on all positions in parallel and gets its own next-token loss; gradients flow through
all passes. Positions are 1-based in comments and 0-based in code.

Packed rows (SFT, ``PackedRows``): several conversations share a row; each attends only to itself,
and its first position takes e_t like position 1 of a sequence, so no state crosses a boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from fbt_megatron.offload import offloading
from fbt_megatron.parallel.sequence import WHOLE_SEQUENCE, SequenceLayout, sequence_layout


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


# ---------------------------------------------------------------- packed rows (SFT)
@dataclass
class PackedRows:
    """Conversations packed into the rows of a microbatch (``fbt_megatron.data.sft``).

    Attention stays inside a conversation (``attention_mask``) and the carried state does not
    cross into the next one: a conversation's first position is never fused. In the fused passes
    the prompt positions keep e_t (the prompt-aware prefix mixin) when ``prompt_prefix`` is set,
    and always in evaluation (prompt-then-generate); otherwise training draws the pretraining
    random prefix per row."""

    segments: torch.Tensor  # [b, s] which conversation each position belongs to (padding: one of its own)
    plain: torch.Tensor  # [b, s] bool: prompt positions (every token that is not the assistant's)
    prompt_prefix: bool = True  # training: the prompt is the prefix (else a random prefix per row)

    @cached_property
    def starts(self) -> torch.Tensor:
        """[b, s] bool: the first position of each conversation (and of the padding)."""
        first = torch.ones_like(self.segments[:, :1], dtype=torch.bool)
        return torch.cat([first, self.segments[:, 1:] != self.segments[:, :-1]], dim=1)

    @cached_property
    def attention_mask(self) -> torch.Tensor:
        """[b, 1, s, s] bool, True = masked (megatron's convention): a later position or another
        conversation. A sliding-window layer adds its window (``layers.FBTDotProductAttention``)."""
        s = self.segments.shape[1]
        later = torch.ones(s, s, dtype=torch.bool, device=self.segments.device).triu(1)
        other = self.segments.unsqueeze(2) != self.segments.unsqueeze(1)
        return (other | later).unsqueeze(1)

    def uses_prompt(self, training: bool) -> bool:
        return self.prompt_prefix or not training

    def fusable(self, training: bool) -> torch.Tensor:
        """[s, b] bool: where a fused pass may use u_t — not at a conversation's first position,
        nor on its prompt when the prompt is the prefix."""
        allowed = ~self.starts
        if self.uses_prompt(training):
            allowed = allowed & ~self.plain
        return allowed.transpose(0, 1)


# ---------------------------------------------------------------- per-sequence random draws
# Prefix lengths and jitter are drawn from generators seeded by (sequence seed, pass, stream), so
# they depend on which sequence is drawn for, never on how the batch is split across ranks or
# microbatches, and a recomputed pass sees the same numbers.
_PREFIX, _JITTER, _SCHEDULE = 1, 2, 3


def _generator(seed: int, index: int, stream: int, device) -> torch.Generator:
    """A generator fixed by (seed, index, stream): (sequence seed, pass) or (run seed, step)."""
    mixed = (seed * 1_000_003 + index * 7_919 + stream) % (2**63 - 1)
    return torch.Generator(device=device).manual_seed(mixed)


def prefix_lengths(config, sequence_seeds: List[int], pass_index: int, seq_len: int) -> torch.Tensor:
    """Prefix mixin: per sequence, with probability q, p ~ U{0, …, ⌊f·T⌋−1}; else p = 0."""
    high = max(1, int(config.prefix_mixin_max_fraction * seq_len))
    lengths = []
    for seed in sequence_seeds:
        g = _generator(seed, pass_index, _PREFIX, "cpu")
        use = torch.rand((), generator=g).item() < config.prefix_mixin_prob
        p = torch.randint(0, high, (), generator=g).item()
        lengths.append(p if use else 0)
    return torch.tensor(lengths, dtype=torch.long)


def fuse_mask(prefix: torch.Tensor, seq_len: int, device) -> torch.Tensor:
    """[s, b] bool, True at 1-based positions t ≥ 2 with t > p."""
    positions = torch.arange(seq_len).unsqueeze(1)  # 0-based index = t − 1
    return (positions >= prefix.clamp(min=1).unsqueeze(0)).to(device)


def jitter(config, sequence_seeds: List[int], pass_index: int, shape, device, dtype) -> torch.Tensor:
    """ε ~ N(0, σ²) of shape [s, b, h], one generator per sequence."""
    seq_len, _, hidden = shape
    noise = [
        torch.randn(seq_len, hidden, generator=_generator(seed, pass_index, _JITTER, device), device=device)
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
    model, tokens, labels, pass_index: int, received: Optional[torch.Tensor], feedback_fn, backward_next: bool = False,
    packed: Optional[PackedRows] = None,
):
    """Pass j of one microbatch on this pipeline stage → ``FBTModel.forward``'s (output, top state).

    ``received`` is what the stage gets from upstream: on the first stage the previous pass's top
    states s^{(j−1)} (None in pass 1), fused with the embeddings by eq. F4; on later stages the
    previous stage's hidden states. With ``recompute_passes`` only these inputs (and e_t) are kept
    (in host memory with ``offload_recompute_inputs``) and the pass is recomputed in backward —
    unless ``backward_next``: the caller runs this pass's backward right after its forward (the
    last pass on the last stage), so its activations are freed as soon as a recompute's would be,
    and checkpointing would only add a forward. ``packed``: the rows hold packed conversations,
    each attending only to itself (on every stage)."""
    embeddings = model.embed(tokens) if model.pre_process else None  # e_t
    attention_mask = None if packed is None else packed.attention_mask

    def forward(embeddings, labels, received):
        if not model.pre_process:
            return model(tokens, labels=labels, hidden_states=received, attention_mask=attention_mask)
        feedback = None if received is None else feedback_fn(received, pass_index)
        return model(tokens, labels=labels, feedback=feedback, embeddings=embeddings, attention_mask=attention_mask)

    if model.config.recompute_passes and not backward_next:
        # e_t and s^{(j−1)} wait for backward in host memory; a pipeline schedule keeps what it received
        held = (received,) if model.config.pipeline_model_parallel_size > 1 else ()
        with offloading(model.config, recomputed=True, keep=held):
            return tensor_parallel.checkpoint(forward, False, embeddings, labels, received)
    return forward(embeddings, labels, received)


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
    whole model on this rank (no pipeline; ``parallel.pipeline`` runs passes across stages).
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


# ---------------------------------------------------------------- the pass schedule
@dataclass(frozen=True)
class PassPhase:
    """From step ``start`` on, k is drawn from ``mixture`` ({k: weight}; a fixed k is {k: 1})."""

    start: int
    mixture: Dict[int, float]

    def describe(self) -> str:
        if len(self.mixture) == 1:
            return f"k = {next(iter(self.mixture))}"
        total = sum(self.mixture.values())
        return "k ~ {" + ", ".join(f"{k}: {w / total:.2f}" for k, w in sorted(self.mixture.items())) + "}"


@dataclass(frozen=True)
class PassSchedule:
    """k for each training step, in phases (e.g. k = 1 for the first 75% of training, then
    {1: 0.75, 2: 0.22, 3: 0.03}). A pure function of (seed, step): every rank, and a resumed run,
    computes the same k without communicating."""

    seed: int
    phases: Tuple[PassPhase, ...]

    def __post_init__(self):
        starts = [p.start for p in self.phases]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"pass phases must start at step 0 and increase, got starts {starts}")

    @classmethod
    def fixed(cls, seed: int, passes: int) -> "PassSchedule":
        return cls(seed, (PassPhase(0, {passes: 1.0}),))

    def phase(self, step: int) -> int:
        """The index of the phase ``step`` belongs to."""
        return max(i for i, p in enumerate(self.phases) if p.start <= step)

    def __call__(self, step: int) -> int:
        mixture = self.phases[self.phase(step)].mixture
        counts = sorted(mixture)
        if len(counts) == 1:
            return counts[0]
        weights = torch.tensor([float(mixture[k]) for k in counts], dtype=torch.float64)
        u = torch.rand((), generator=_generator(self.seed, step, _SCHEDULE, "cpu"), dtype=torch.float64)
        index = int(torch.searchsorted(weights.cumsum(0) / weights.sum(), u, right=True).clamp(max=len(counts) - 1))
        return counts[index]

    def expected_passes(self, steps: int) -> Dict[int, float]:
        """The expected number of steps with each k over steps [0, steps) (planning, reports)."""
        out: Dict[int, float] = {}
        for i, p in enumerate(self.phases):
            end = min(steps, self.phases[i + 1].start if i + 1 < len(self.phases) else steps)
            total = sum(p.mixture.values())
            for k, w in p.mixture.items():
                out[k] = out.get(k, 0.0) + max(0, end - p.start) * w / total
        return out

    def describe(self) -> str:
        """The schedule in words, e.g. "k = 1 from step 0, k ~ {1: 0.75, 2: 0.22, 3: 0.03} from step 600"."""
        return ", ".join(f"{p.describe()} from step {p.start}" for p in self.phases)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "phases": [{"start": p.start, "mixture": dict(p.mixture)} for p in self.phases]}
