"""The one mapping between megatron-core's FBT weights and the Hugging Face export's, both ways,
and between ``FBTConfig`` and the export's config.json.

Weights (megatron name → HF name; the tied lm_head is not stored)::

    embedding.word_embeddings.weight                 → model.embed_tokens.weight
    decoder.layers.N.input_layernorm.weight          → model.layers.N.input_layernorm.weight
    decoder.layers.N.self_attention.linear_qkv.weight → model.layers.N.self_attn.{q,k,v}_proj.weight
        (megatron's rows: per query group g, [q_per_group·hd rows of q, hd of k, hd of v])
    ...self_attention.{q,k}_layernorm.weight         → ...self_attn.{q,k}_norm.weight
    ...self_attention.linear_gate.weight             → ...self_attn.gate_proj.weight     (headwise gate)
    ...self_attention.linear_proj.weight             → ...self_attn.o_proj.weight
    ...post_self_attn_layernorm.weight               → ...post_attention_layernorm.weight  (sandwich)
    ...pre_mlp_layernorm.weight                      → ...pre_feedforward_layernorm.weight
    ...mlp.linear_fc1.weight ([gate; up])            → ...mlp.gate_proj.weight, ...mlp.up_proj.weight
    ...mlp.linear_fc2.weight                         → ...mlp.down_proj.weight
    ...post_mlp_layernorm.weight                     → ...post_feedforward_layernorm.weight (sandwich)
    final_layernorm.weight                           → model.norm.weight
    feedback_fusion.linear_state.weight (W_U)        → model.feedback.up_proj.weight
    feedback_fusion.linear_gate.weight (W_G)         → model.feedback.gate_proj.weight
    feedback_fusion.norm.weight                      → model.feedback.norm.weight

Splitting and joining are exact copies (no arithmetic), so megatron → HF → megatron is bit-exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from fbt_megatron.common.errors import ConversionError
from fbt_megatron.model.decode_modes import default_mode


# ---------------------------------------------------------------- the shape of a model
@dataclass(frozen=True)
class Shape:
    """What the weight mapping needs to know of a model."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    qk_norm: bool
    attention_gate: bool
    sandwich_norm: bool
    latent_feedback: bool

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @staticmethod
    def of_config(c) -> "Shape":
        """From an FBTConfig."""
        return Shape(
            num_layers=c.num_layers,
            hidden_size=c.hidden_size,
            ffn_hidden_size=c.ffn_hidden_size,
            num_attention_heads=c.num_attention_heads,
            num_query_groups=c.num_query_groups or c.num_attention_heads,
            head_dim=c.kv_channels,
            vocab_size=c.vocab_size,
            qk_norm=c.qk_layernorm,
            attention_gate=c.headwise_attention_gate,
            sandwich_norm=c.sandwich_norm,
            latent_feedback=c.latent_feedback,
        )

    @staticmethod
    def of_hf(h: dict) -> "Shape":
        """From an export's config.json (``hf_config``'s keys)."""
        return Shape(
            num_layers=h["num_hidden_layers"],
            hidden_size=h["hidden_size"],
            ffn_hidden_size=h["intermediate_size"],
            num_attention_heads=h["num_attention_heads"],
            num_query_groups=h["num_key_value_heads"],
            head_dim=h["head_dim"],
            vocab_size=h["vocab_size"],
            qk_norm=h["qk_norm"],
            attention_gate=h["attention_gate"],
            sandwich_norm=h["sandwich_norm"],
            latent_feedback=h["latent_feedback"],
        )


# ---------------------------------------------------------------- names
def _layer_names(shape: Shape, n: int) -> Dict[str, str]:
    """megatron name → HF name of layer n's one-to-one weights (qkv and fc1 are split separately)."""
    m, h = f"decoder.layers.{n}.", f"model.layers.{n}."
    names = {
        m + "input_layernorm.weight": h + "input_layernorm.weight",
        m + "self_attention.linear_proj.weight": h + "self_attn.o_proj.weight",
        m + "pre_mlp_layernorm.weight": h + "pre_feedforward_layernorm.weight",
        m + "mlp.linear_fc2.weight": h + "mlp.down_proj.weight",
    }
    if shape.qk_norm:
        names[m + "self_attention.q_layernorm.weight"] = h + "self_attn.q_norm.weight"
        names[m + "self_attention.k_layernorm.weight"] = h + "self_attn.k_norm.weight"
    if shape.attention_gate:
        names[m + "self_attention.linear_gate.weight"] = h + "self_attn.gate_proj.weight"
    if shape.sandwich_norm:
        names[m + "post_self_attn_layernorm.weight"] = h + "post_attention_layernorm.weight"
        names[m + "post_mlp_layernorm.weight"] = h + "post_feedforward_layernorm.weight"
    return names


def _global_names(shape: Shape) -> Dict[str, str]:
    names = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "final_layernorm.weight": "model.norm.weight",
    }
    if shape.latent_feedback:
        names["feedback_fusion.linear_state.weight"] = "model.feedback.up_proj.weight"
        names["feedback_fusion.linear_gate.weight"] = "model.feedback.gate_proj.weight"
        names["feedback_fusion.norm.weight"] = "model.feedback.norm.weight"
    return names


def megatron_names(shape: Shape) -> List[str]:
    """Every weight of the megatron model, in a fixed order."""
    names = ["embedding.word_embeddings.weight"]
    for n in range(shape.num_layers):
        names += [f"decoder.layers.{n}.self_attention.linear_qkv.weight", f"decoder.layers.{n}.mlp.linear_fc1.weight"]
        names += list(_layer_names(shape, n))
    return names + [k for k in _global_names(shape) if k != "embedding.word_embeddings.weight"]


def hf_names(shape: Shape) -> List[str]:
    """Every tensor of the HF export, in the order they are written."""
    names = ["model.embed_tokens.weight"]
    for n in range(shape.num_layers):
        h = f"model.layers.{n}."
        names += [h + "self_attn.q_proj.weight", h + "self_attn.k_proj.weight", h + "self_attn.v_proj.weight"]
        names += [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"]
        names += list(_layer_names(shape, n).values())
    return names + [v for v in _global_names(shape).values() if v != "model.embed_tokens.weight"]


def hf_shapes(shape: Shape) -> Dict[str, tuple]:
    """The shape of every HF tensor."""
    d, f, hd = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    nq, ng = shape.num_attention_heads, shape.num_query_groups
    by_suffix = {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "pre_feedforward_layernorm.weight": (d,), "post_feedforward_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (nq * hd, d), "self_attn.k_proj.weight": (ng * hd, d),
        "self_attn.v_proj.weight": (ng * hd, d), "self_attn.o_proj.weight": (d, nq * hd),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,), "self_attn.gate_proj.weight": (nq, d),
        "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
    }
    fixed = {
        "model.embed_tokens.weight": (shape.vocab_size, d), "model.norm.weight": (d,),
        "model.feedback.up_proj.weight": (d, d), "model.feedback.gate_proj.weight": (d, d),
        "model.feedback.norm.weight": (d,),
    }
    out = {}
    for name in hf_names(shape):
        out[name] = fixed[name] if name in fixed else by_suffix[name.split(".", 3)[3]]
    return out


# ---------------------------------------------------------------- weights, both ways
def _check_shapes(kind: str, tensors: Dict[str, torch.Tensor], expected: Dict[str, tuple]) -> None:
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConversionError(f"the {kind} weights lack {missing[0]}{more}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ConversionError(f"{kind} weight {name} has shape {list(tensors[name].shape)}, expected {list(shape)}")


def to_hf(state: Dict[str, torch.Tensor], shape: Shape) -> Dict[str, torch.Tensor]:
    """megatron state dict (one process, TP1) → HF tensors (contiguous copies, in ``hf_names`` order)."""
    d, f, hd = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    ng, per = shape.num_query_groups, shape.q_per_group
    expected = {n: None for n in megatron_names(shape)}
    missing = [n for n in expected if n not in state]
    if missing:
        raise ConversionError(f"the model's state has no {missing[0]}")
    out = {}
    for n in range(shape.num_layers):
        m, h = f"decoder.layers.{n}.", f"model.layers.{n}."
        qkv = state[m + "self_attention.linear_qkv.weight"]
        if tuple(qkv.shape) != (ng * (per + 2) * hd, d):
            raise ConversionError(f"{m}self_attention.linear_qkv.weight has shape {list(qkv.shape)}, "
                                  f"expected {[ng * (per + 2) * hd, d]}")
        groups = qkv.view(ng, (per + 2) * hd, d)
        out[h + "self_attn.q_proj.weight"] = groups[:, : per * hd].reshape(ng * per * hd, d)
        out[h + "self_attn.k_proj.weight"] = groups[:, per * hd : (per + 1) * hd].reshape(ng * hd, d)
        out[h + "self_attn.v_proj.weight"] = groups[:, (per + 1) * hd :].reshape(ng * hd, d)
        fc1 = state[m + "mlp.linear_fc1.weight"]
        if tuple(fc1.shape) != (2 * f, d):
            raise ConversionError(f"{m}mlp.linear_fc1.weight has shape {list(fc1.shape)}, expected {[2 * f, d]}")
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = fc1[:f], fc1[f:]
        for src, dst in _layer_names(shape, n).items():
            out[dst] = state[src]
    for src, dst in _global_names(shape).items():
        out[dst] = state[src]
    out = {name: out[name].detach().to("cpu").contiguous().clone() for name in hf_names(shape)}
    _check_shapes("megatron", out, hf_shapes(shape))
    return out


def from_hf(tensors: Dict[str, torch.Tensor], shape: Shape, fusion: bool = True) -> Dict[str, torch.Tensor]:
    """HF tensors → megatron state dict entries. ``fusion=False``: the fusion weights are not
    expected (a plain Llama-style checkpoint; the FBT model keeps freshly initialised ones)."""
    expected = hf_shapes(shape)
    if not fusion:
        expected = {k: v for k, v in expected.items() if not k.startswith("model.feedback.")}
    _check_shapes("Hugging Face", tensors, expected)
    f, hd, d = shape.ffn_hidden_size, shape.head_dim, shape.hidden_size
    ng, per = shape.num_query_groups, shape.q_per_group
    out = {}
    for n in range(shape.num_layers):
        m, h = f"decoder.layers.{n}.", f"model.layers.{n}."
        q = tensors[h + "self_attn.q_proj.weight"].reshape(ng, per * hd, d)
        k = tensors[h + "self_attn.k_proj.weight"].reshape(ng, hd, d)
        v = tensors[h + "self_attn.v_proj.weight"].reshape(ng, hd, d)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(ng * (per + 2) * hd, d)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([tensors[h + "mlp.gate_proj.weight"], tensors[h + "mlp.up_proj.weight"]])
        for src, dst in _layer_names(shape, n).items():
            out[src] = tensors[dst]
    for src, dst in _global_names(shape).items():
        if dst in expected:
            out[src] = tensors[dst]
    return out


# ---------------------------------------------------------------- config.json
def layer_types(num_layers: int, sliding_window: Optional[int], full_attention_every: Optional[int]) -> List[str]:
    """Per layer (0-based list, 1-based rule): "full_attention" iff there is no window or
    l % full_attention_every == 0, else "sliding_attention"."""
    return [
        "full_attention" if sliding_window is None or (full_attention_every and l % full_attention_every == 0)
        else "sliding_attention"
        for l in range(1, num_layers + 1)
    ]


def hf_config(c, bos: Optional[int], eos: Optional[int], pad: Optional[int], with_tokenizer: bool) -> dict:
    """The export's config.json (the contract's keys) from an FBTConfig."""
    auto_map = {"AutoConfig": "configuration_fbt.FBTConfig", "AutoModelForCausalLM": "modeling_fbt.FBTForCausalLM"}
    if with_tokenizer:
        auto_map["AutoTokenizer"] = ["tokenization_fbt.FBTTokenizer", None]
    return {
        "architectures": ["FBTForCausalLM"],
        "auto_map": auto_map,
        "model_type": "fbt",
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_query_groups or c.num_attention_heads,
        "head_dim": c.kv_channels,
        "intermediate_size": c.ffn_hidden_size,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.layernorm_epsilon,
        "rope_theta": float(c.rotary_base),
        "max_position_embeddings": c.seq_length,
        "sliding_window": c.sliding_window,
        "full_attention_every": c.full_attention_every,
        "layer_types": layer_types(c.num_layers, c.sliding_window, c.full_attention_every),
        "residual_scale": c.depth_scale,
        "sandwich_norm": c.sandwich_norm,
        "attention_gate": c.headwise_attention_gate,
        "qk_norm": c.qk_layernorm,
        "latent_feedback": c.latent_feedback,
        "feedback_source": c.feedback_state,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "decode_mode": default_mode(c.latent_feedback),
        "fused_prefill_passes": 0,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


# defaults of the contract's keys (an export written by an older converter may lack some)
HF_DEFAULTS = {
    "sliding_window": None, "full_attention_every": None, "sandwich_norm": True, "attention_gate": True,
    "qk_norm": True, "latent_feedback": True, "feedback_source": "residual", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 8192, "hidden_act": "silu", "tie_word_embeddings": True,
}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def complete_fbt_config(h: dict) -> dict:
    """An export's config.json with the contract's defaults filled in and checked."""
    missing = [k for k in _REQUIRED if k not in h]
    if missing:
        raise ConversionError(f"config.json lacks {', '.join(missing)}")
    h = {**HF_DEFAULTS, **h}
    h.setdefault("num_key_value_heads", h["num_attention_heads"])
    h.setdefault("head_dim", h["hidden_size"] // h["num_attention_heads"])
    if h.get("residual_scale") is None:
        h["residual_scale"] = 1.0 / math.sqrt(2 * h["num_hidden_layers"])
    if h["hidden_act"] != "silu":
        raise ConversionError(f"hidden_act {h['hidden_act']!r} is not supported (only silu)")
    if not h["tie_word_embeddings"]:
        raise ConversionError("untied embeddings (tie_word_embeddings false) are not supported: FBT ties the output layer")
    if h["feedback_source"] not in ("residual", "final_norm"):
        raise ConversionError(f"feedback_source {h['feedback_source']!r} is not one of residual, final_norm")
    if h["num_attention_heads"] % h["num_key_value_heads"]:
        raise ConversionError(f"num_attention_heads {h['num_attention_heads']} is not a multiple of "
                              f"num_key_value_heads {h['num_key_value_heads']}")
    return h


def fbt_fields(h: dict) -> dict:
    """FBTConfig fields (a recipe's model overrides, all architecture fields explicit) of a
    completed config.json; vocab_size and seq_length are recorded elsewhere in a run."""
    return {
        "num_layers": h["num_hidden_layers"],
        "hidden_size": h["hidden_size"],
        "ffn_hidden_size": h["intermediate_size"],
        "num_attention_heads": h["num_attention_heads"],
        "num_query_groups": h["num_key_value_heads"],
        "kv_channels": h["head_dim"],
        "layernorm_epsilon": float(h["rms_norm_eps"]),
        "rotary_base": float(h["rope_theta"]),
        "sliding_window": h["sliding_window"],
        "full_attention_every": h["full_attention_every"],
        "depth_scale": float(h["residual_scale"]),
        "sandwich_norm": bool(h["sandwich_norm"]),
        "headwise_attention_gate": bool(h["attention_gate"]),
        "qk_layernorm": bool(h["qk_norm"]),
        "latent_feedback": bool(h["latent_feedback"]),
        "feedback_state": h["feedback_source"],
    }
