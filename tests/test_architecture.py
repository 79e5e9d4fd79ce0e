"""The megatron-core FBT model against an independent implementation (tests/reference.py)."""

import pytest
import torch
from helpers import build, tokens
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from reference import Reference

# Each variant switches one architectural feature; a short window (8 < T = 24) makes the window
# matter; every 2nd layer is global in the tiny preset.
VARIANTS = {
    "paper": {},
    "global_attention": dict(sliding_window=None),
    "no_headwise_gate": dict(headwise_attention_gate=False),
    "no_qk_norm": dict(qk_layernorm=False),
    "no_sandwich_norm": dict(sandwich_norm=False),
    "depth_scale_1": dict(depth_scale=1.0),
    "rope_base_500k": dict(rotary_base=500000.0),
}


def logits_of(model, x):
    model.eval()
    with torch.no_grad():
        out, _ = model(x)
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_single_pass_matches_reference(variant):
    model = build(**{"sliding_window": 8, **VARIANTS[variant]})
    x = tokens()[:, :-1]
    ref_logits, _ = Reference(model.config, model.state_dict()).forward(x)
    torch.testing.assert_close(logits_of(model, x), ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "feature, change",
    [
        ("sliding_window", dict(sliding_window=9)),
        ("full_attention_every", dict(full_attention_every=3)),
        ("headwise_attention_gate", dict(headwise_attention_gate=False)),
        ("qk_layernorm", dict(qk_layernorm=False)),
        ("sandwich_norm", dict(sandwich_norm=False)),
    ],
)
def test_reference_is_sensitive_to_each_feature(feature, change):
    """Negative control: the comparison above would catch a feature implemented wrongly."""
    import dataclasses

    model = build(sliding_window=8)
    x = tokens()[:, :-1]
    other = dataclasses.replace(model.config, **change)
    wrong, _ = Reference(other, model.state_dict()).forward(x)
    assert (logits_of(model, x) - wrong).abs().max() > 1e-3, feature


def test_window_semantics_w_tokens_including_itself():
    """With W = 1 every windowed layer sees only its own token: position t's output then cannot
    depend on earlier tokens when every layer is windowed."""
    model = build(sliding_window=1, full_attention_every=None)
    x = tokens()[:, :-1]
    y = x.clone()
    y[:, :5] = (y[:, :5] + 1) % 1024
    a, b = logits_of(model, x), logits_of(model, y)
    torch.testing.assert_close(a[:, 5:], b[:, 5:], rtol=0, atol=1e-6)
    assert (a[:, :5] - b[:, :5]).abs().max() > 1e-3


def test_k1_equals_megatron_gptmodel():
    """α = 1, no post norms, no gate: one pass of FBT is megatron-core's plain GPTModel."""
    model = build(depth_scale=1.0, sandwich_norm=False, headwise_attention_gate=False, sliding_window=8)
    config = model.config
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
        vocab_size=config.vocab_size,
        max_sequence_length=config.seq_length,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        rotary_base=config.rotary_base,
    )
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("feedback_fusion.")}
    state["decoder.final_layernorm.weight"] = state.pop("final_layernorm.weight")
    missing, unexpected = gpt.load_state_dict(state, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
    x = tokens()[:, :-1]
    gpt.eval()
    with torch.no_grad():
        expected = gpt(x, None, None)
    torch.testing.assert_close(logits_of(model, x), expected, rtol=1e-6, atol=1e-6)


def test_the_te_specs_fused_mlp_norm_keeps_the_local_checkpoint_name():
    """Under Transformer Engine the MLP's input norm is a parameter of TE's fused norm + linear
    (``mlp.linear_fc1.layer_norm_weight``); the layer's key map (``model.FUSED_NORM_KEYS``) must give it
    the local spec's checkpoint name, so that a checkpoint moves between the specs (GPU training, CPU
    tools, the export's mapping). Mapped as megatron-core maps it (TransformerLayer's
    apply_prefix_mapping, then TransformerBlock's layer prefix), against the local model's real key."""
    import dataclasses

    from megatron.core.dist_checkpointing.utils import apply_prefix_mapping, replace_prefix_for_sharding

    from fbt_megatron.model.fbt_model import FUSED_NORM_KEYS

    local = build().sharded_state_dict()
    layer = "decoder.layers.0."
    norm = local[f"{layer}pre_mlp_layernorm.weight"]  # its checkpoint key: the layers' stacked tensor's
    te = {f"{layer}mlp.linear_fc1.layer_norm_weight": dataclasses.replace(norm, key=f"{layer}mlp.linear_fc1.layer_norm_weight")}
    apply_prefix_mapping(te, {f"{layer}{k}": f"{layer}{v}" for k, v in FUSED_NORM_KEYS.items()})
    replace_prefix_for_sharding(te, layer, "decoder.layers.")
    assert [t.key for t in te.values()] == [norm.key] == ["decoder.layers.pre_mlp_layernorm.weight"]
