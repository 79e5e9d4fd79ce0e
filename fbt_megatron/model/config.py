"""The model's configuration: megatron-core's TransformerConfig plus what FBT adds.

Architecture fields follow the paper's names; megatron-core fields (window_size,
window_attn_skip_freq, ...) are derived in ``__post_init__`` so there is one source of truth.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from fbt_megatron.common import platform
from fbt_megatron.model import te_calls


@dataclass
class FBTConfig(TransformerConfig):
    # --- language model (GPTModel arguments, kept here so a config describes a whole model)
    vocab_size: int = 100352
    """Vocabulary size as used by the embedding (already padded; see tokenizer padding)."""
    seq_length: int = 8192
    rotary_base: float = 10000.0
    """RoPE base θ."""

    # --- backbone details of the paper's architecture
    depth_scale: Optional[float] = None
    """α in h ← h + α·RMSNorm_post(Sublayer(RMSNorm_pre(h))); None means 1/√(2L)."""
    sandwich_norm: bool = True
    """RMSNorm after every sublayer (before the residual add)."""
    headwise_attention_gate: bool = True
    """Scale each head's attention output by sigmoid(w_hᵀ x) before the output projection."""
    sliding_window: Optional[int] = None
    """W: position t attends to t−W+1 … t; None: every layer is global."""
    full_attention_every: Optional[int] = None
    """Layers whose 1-based index is divisible by this use global attention (paper: 6)."""

    # --- latent feedback (the FBT part)
    latent_feedback: bool = True
    """Build the fusion u_t = RMSNorm(W_U s_{t−1} ⊙ σ(W_G e_t)); False gives the plain baseline."""
    feedback_state: Literal["residual", "final_norm"] = "residual"
    """Which top state s is fed back: the last layer's residual stream, or it after the final norm."""
    feedback_jitter: float = 0.02
    """σ of the Gaussian jitter added to the carried state while training."""
    prefix_mixin_prob: float = 0.5
    """Per sequence and fused pass: probability of keeping a random prefix on plain embeddings."""
    prefix_mixin_max_fraction: float = 1.0
    """The prefix length p is uniform on {0, …, ⌊f·T⌋−1} (f=1: uniform over the sequence)."""
    pass_weights: Optional[tuple] = None
    """Weights of the per-pass losses in the total; None means the mean over passes."""
    detach_feedback: bool = False
    """Ablation only: stop gradients at the carried state (truncated backprop through passes)."""
    recompute_passes: bool = False
    """Pass-level activation checkpointing: keep each pass's input, recompute the pass in backward."""
    offload_recompute_inputs: bool = False
    """Keep what activation recompute saves (pass inputs; layer inputs under full recompute) in
    pinned host memory from forward to backward (``fbt_megatron.model.offload``)."""

    # --- Transformer Engine's per-call state under k passes (``fbt_megatron.model.te_calls``)
    disable_parameter_transpose_cache: Optional[bool] = None
    """None: on with latent feedback (TE then always accumulates weight gradients and quantizes
    weights at every call; with the weight cache, pass 1 overwrites passes 2..k's gradients)."""
    fp8_recipe: Optional[Literal["tensorwise", "delayed", "mxfp8", "blockwise", "custom"]] = None
    """Under ``fp8``; None: tensorwise (current scaling), mxfp8 on Blackwell; delayed is refused
    with recompute_passes and needs a long max history with k > 1."""

    def __post_init__(self):
        if self.num_layers < 1 or self.num_attention_heads < 1:
            raise ValueError(f"num_layers and num_attention_heads must be >= 1, got {self.num_layers} and {self.num_attention_heads}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} does not divide hidden_size {self.hidden_size}: "
                             "give a divisor of it (or kv_channels, each head's width)")
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_query_groups {self.num_query_groups} does not divide num_attention_heads "
                             f"{self.num_attention_heads}: each key/value group serves as many heads")
        if self.depth_scale is None:
            self.depth_scale = 1.0 / math.sqrt(2 * self.num_layers)
        if self.sliding_window is not None:
            if self.sliding_window < 1:
                raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
            # megatron/TE convention (left, right): W tokens including the current one
            self.window_size = (self.sliding_window - 1, 0)
            self.window_attn_skip_freq = self.full_attention_every
        if self.context_parallel_size > 1 and self.sliding_window is not None:
            self.cp_comm_type = windowed_cp_comm_type(self)
        if not 0.0 <= self.prefix_mixin_prob <= 1.0:
            raise ValueError(f"prefix_mixin_prob must be in [0, 1], got {self.prefix_mixin_prob}")
        if not 0.0 < self.prefix_mixin_max_fraction <= 1.0:
            raise ValueError("prefix_mixin_max_fraction must be in (0, 1]")
        te_calls.settle(self)
        super().__post_init__()
        full_uniform = self.recompute_granularity == "full" and self.recompute_method == "uniform"
        if self.offload_recompute_inputs and not (self.recompute_passes or full_uniform):
            raise ValueError(
                "offload_recompute_inputs moves the inputs of recomputed regions: it needs recompute_passes, "
                "or recompute_granularity 'full' with recompute_method 'uniform'"
            )


# Transformer Engine's context parallelism supports sliding windows only with these communication
# types (TE attn_forward_func_with_cp: "Context parallelism does not support sliding window attention
# with cp_comm_type='p2p'"); megatron-core passes 'p2p' when cp_comm_type is None.
WINDOWED_CP_COMM_TYPES = ("a2a", "all_gather")


def windowed_cp_comm_type(config) -> str:
    """The CP communication type of a model with a sliding window: the one asked for, if TE accepts
    it, else 'a2a' (TE's a2a needs the heads and KV groups of a TP rank to divide by CP), else
    'all_gather'. One type for every layer: megatron-core 0.16.1 indexes a per-layer list off by one
    (``config.cp_comm_type[self.layer_number]`` with 1-based layer numbers; fixed in 0.19)."""
    asked, cp, tp = config.cp_comm_type, config.context_parallel_size, config.tensor_model_parallel_size
    heads, groups = config.num_attention_heads // tp, (config.num_query_groups or config.num_attention_heads) // tp
    a2a_fits = heads % cp == 0 and groups % cp == 0
    if isinstance(asked, (list, tuple)):
        raise ValueError("cp_comm_type: give one type for every layer (megatron-core 0.16.1 reads a per-layer list "
                         "off by one), e.g. cp_comm_type: a2a")
    if asked is not None and asked not in WINDOWED_CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type {asked!r} with sliding_window {config.sliding_window}: Transformer Engine's "
                         f"context parallelism takes windows only with {' or '.join(WINDOWED_CP_COMM_TYPES)}; set "
                         "cp_comm_type to one of them, or leave it unset to have one chosen")
    if asked == "a2a" and not a2a_fits:
        raise ValueError(f"cp_comm_type 'a2a' needs the {heads} heads and {groups} KV groups of a TP rank to divide by "
                         f"CP {cp}: use cp_comm_type all_gather, or another TP / CP")
    return asked or ("a2a" if a2a_fits else "all_gather")


# Presets: the paper's architecture at two sizes. Fields not listed take FBTConfig's defaults.
_COMMON = dict(
    normalization="RMSNorm",
    layernorm_epsilon=1e-6,
    qk_layernorm=True,
    gated_linear_unit=True,  # SwiGLU: W_down(silu(W_gate x) ⊙ W_up x)
    activation_func=F.silu,
    add_bias_linear=False,
    add_qkv_bias=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    init_method_std=0.02,
)

PRESETS = {
    "tiny": dict(
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=192,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        vocab_size=1024,
        seq_length=128,
        sliding_window=32,
        full_attention_every=2,
    ),
    "fbt-1b": dict(
        num_layers=24,
        hidden_size=1536,
        ffn_hidden_size=6656,
        num_attention_heads=16,
        num_query_groups=8,
        kv_channels=96,
        vocab_size=100352,
        seq_length=8192,
        sliding_window=2048,
        full_attention_every=6,
    ),
}


# The fields that set the model's parameters: their shapes (sizes, heads, layers) or whether they
# exist (biases, norms, the headwise gate, the feedback fusion). Weights carry over from one run to
# another (a stage: ``fbt_megatron.trainer.stages``) only when these, and the padded vocabulary, are equal;
# every other field (RoPE base, windows, jitter, prefix mixin, recompute, ...) may change.
ARCHITECTURE = frozenset({
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "normalization", "qk_layernorm", "sandwich_norm",
    "headwise_attention_gate", "latent_feedback",
})


def preset_fields(preset: str, **overrides) -> dict:
    """The fields ``make_config`` sets for a preset and overrides (FBTConfig's defaults give the rest)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    return {**_COMMON, **PRESETS[preset], **overrides}


def field_default(name: str):
    """FBTConfig's default of field ``name``."""
    found = next(f for f in dataclasses.fields(FBTConfig) if f.name == name)
    return found.default_factory() if found.default is dataclasses.MISSING else found.default


def given_fields(preset: str, **overrides) -> dict:
    """The fields ``make_config`` gives FBTConfig: the preset's and ``overrides`` (``preset_fields``),
    then this machine's choices (FBTConfig's defaults and ``__post_init__`` give the rest)."""
    fields = preset_fields(preset, **overrides)
    fields.setdefault("params_dtype", torch.float32)
    fields.setdefault("pipeline_dtype", fields["params_dtype"])  # what stages send each other
    # CPU: initialise full weights then split them, so every TP layout starts identical (PP changes
    # the order layers are initialised in: compare PP layouts from a seed checkpoint); a device (a GPU,
    # or the simulated one of the tests) initialises each rank's shard where it lives, as megatron does
    fields.setdefault("use_cpu_initialization", platform.device().type == "cpu")
    fields.setdefault("apply_rope_fusion", platform.have_transformer_engine())  # TE's kernel of the same RoPE
    return fields


def make_config(preset: str, **overrides) -> FBTConfig:
    """An FBTConfig for a preset; ``overrides`` are any FBTConfig/TransformerConfig fields."""
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(FBTConfig)})
    if unknown:
        raise ValueError(f"unknown model config field(s): {', '.join(unknown)}")
    return FBTConfig(**given_fields(preset, **overrides))


def recipe_config(recipe, vocab_size: Optional[int] = None, **fields) -> FBTConfig:
    """The FBTConfig of a recipe's model (``fbt_megatron.recipe.Recipe``): its preset and model
    overrides, the data's sequence length and the embedding's (padded) vocabulary size (None: the
    preset's), then ``fields`` (a parallel layout, a precision, meta-device initialisation)."""
    vocab = {} if vocab_size is None else {"vocab_size": vocab_size}
    return make_config(recipe.model.preset, **{**recipe.model_overrides, **vocab, "seq_length": recipe.data.seq_length, **fields})
