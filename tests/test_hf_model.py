"""The self-contained Hugging Face model code of exports (fbt_megatron/inference/convert/hf/).

Checked: the HF forward equals the megatron model's passes (weights mapped by name); cached
generation equals recomputation without a cache in every decoding mode, with left-padded batches
and generation beyond the sliding window; soft/fused decoding equal the k-pass definitions;
``decode_logits`` equals what ``generate`` produced; save → from_pretrained(trust_remote_code) as
exports do; the remote-code tokenizer equals sentencepiece.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import build
from reference import Reference

from fbt_megatron.inference.convert.hf.configuration_fbt import FBTConfig
from fbt_megatron.inference.convert.hf.modeling_fbt import FBTForCausalLM

HF_DIR = Path(__file__).parent.parent / "fbt_megatron" / "inference" / "convert" / "hf"
REMOTE_CODE = ("configuration_fbt.py", "modeling_fbt.py", "tokenization_fbt.py")
AUTO_MAP = {"AutoConfig": "configuration_fbt.FBTConfig", "AutoModelForCausalLM": "modeling_fbt.FBTForCausalLM"}
MODES = [("standard", 0), ("soft", 0), ("fused", 2)]

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=4,
    full_attention_every=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=None,  # generation runs to max_new_tokens
    pad_token_id=0,
)


def tiny_model(seed=0, dtype=torch.float32, **overrides) -> FBTForCausalLM:
    """The tiny HF model with random weights, norms included (a misplaced norm is visible).
    Recurrence-heavy comparisons run in float64: there, 1e-5 separates logic from rounding (in
    float32, dozens of fed-back passes legitimately drift by ~1e-5)."""
    torch.manual_seed(seed)
    model = FBTForCausalLM(FBTConfig(**{**TINY, **overrides})).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "embed_tokens" in name:
                p.normal_(0, 0.5)  # sharper logits: greedy choices far from ties
    return model


def left_padded(prompts, pad=0):
    """A batch of token lists of different lengths, padded on the left, with its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def random_prompts(lengths, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(model, ids, mask, mode, n, new_tokens=7, **kwargs):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, decode_mode=mode,
        fused_prefill_passes=n, output_logits=True, return_dict_in_generate=True, **kwargs,
    )


# ---------------------------------------------------------------- megatron → HF
def hf_from_megatron(model) -> FBTForCausalLM:
    """The HF model with the megatron model's weights, mapped by the export contract's name table
    (a test-local mapping: the converter owns the real one)."""
    c = model.config
    hf = FBTForCausalLM(FBTConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels, rms_norm_eps=c.layernorm_epsilon,
        rope_theta=c.rotary_base, max_position_embeddings=c.seq_length, sliding_window=c.sliding_window,
        full_attention_every=c.full_attention_every, residual_scale=c.depth_scale, sandwich_norm=c.sandwich_norm,
        attention_gate=c.headwise_attention_gate, qk_norm=c.qk_layernorm, latent_feedback=c.latent_feedback,
        feedback_source=c.feedback_state,
    )).eval()
    src = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and v.is_floating_point()}
    heads, groups, hd = c.num_attention_heads, c.num_query_groups, c.kv_channels
    per = heads // groups
    out = {"model.embed_tokens.weight": src["embedding.word_embeddings.weight"],
           "model.norm.weight": src["final_layernorm.weight"]}
    if c.latent_feedback:
        out["model.feedback.up_proj.weight"] = src["feedback_fusion.linear_state.weight"]
        out["model.feedback.gate_proj.weight"] = src["feedback_fusion.linear_gate.weight"]
        out["model.feedback.norm.weight"] = src["feedback_fusion.norm.weight"]
    for i in range(c.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = src[m + "self_attention.linear_qkv.weight"].view(groups, (per + 2) * hd, -1)
        out[h + "self_attn.q_proj.weight"] = qkv[:, : per * hd].reshape(heads * hd, -1)
        out[h + "self_attn.k_proj.weight"] = qkv[:, per * hd : (per + 1) * hd].reshape(groups * hd, -1)
        out[h + "self_attn.v_proj.weight"] = qkv[:, (per + 1) * hd :].reshape(groups * hd, -1)
        out[h + "self_attn.o_proj.weight"] = src[m + "self_attention.linear_proj.weight"]
        if c.qk_layernorm:
            out[h + "self_attn.q_norm.weight"] = src[m + "self_attention.q_layernorm.weight"]
            out[h + "self_attn.k_norm.weight"] = src[m + "self_attention.k_layernorm.weight"]
        if c.headwise_attention_gate:
            out[h + "self_attn.gate_proj.weight"] = src[m + "self_attention.linear_gate.weight"]
        out[h + "input_layernorm.weight"] = src[m + "input_layernorm.weight"]
        out[h + "pre_feedforward_layernorm.weight"] = src[m + "pre_mlp_layernorm.weight"]
        if c.sandwich_norm:
            out[h + "post_attention_layernorm.weight"] = src[m + "post_self_attn_layernorm.weight"]
            out[h + "post_feedforward_layernorm.weight"] = src[m + "post_mlp_layernorm.weight"]
        gate, up = src[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = src[m + "mlp.linear_fc2.weight"]
    missing, unexpected = hf.load_state_dict(out, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(feedback_state="final_norm", sandwich_norm=False, headwise_attention_gate=False,
              full_attention_every=None, qk_layernorm=False)],
    ids=["paper", "variant"],
)
def test_forward_matches_megatron_passes(overrides):
    """forward(num_passes=k) equals the megatron model's k-th pass (fbt.run_pass, eval mode) for
    k = 1, 2, 3, a padded row equals its unpadded self, and soft decoding equals the reference
    implementation's decoding recurrence (tests/reference.py) on the megatron weights."""
    from fbt_megatron.evaluation.tasks.evaluate import pass_logits

    model = build(seed=1, vocab_size=256, sliding_window=4, **overrides).eval()
    hf = hf_from_megatron(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 12), generator=g)
    with torch.no_grad():
        for k, expected in enumerate(pass_logits(model, x, 3), start=1):
            got = hf(x, num_passes=k, use_cache=False).logits
            print(f"k={k} max|hf - megatron| = {(got - expected).abs().max():.2e}")
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        # the same rows left-padded to 15: positions and fusion count from the first real token
        ids, mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), x], 1), torch.ones(2, 15, dtype=torch.long)
        mask[:, :3] = 0
        padded = hf(ids, attention_mask=mask, num_passes=3, use_cache=False).logits[:, 3:]
        torch.testing.assert_close(padded, expected, rtol=0, atol=1e-5)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # whatever position ids padding has
        padded = hf(ids, attention_mask=mask, position_ids=positions, num_passes=3, use_cache=False).logits[:, 3:]
        torch.testing.assert_close(padded, expected, rtol=0, atol=1e-5)
        # soft decoding after a 5-token prompt == the reference's token-by-token recurrence
        expected = Reference(model.config, model.state_dict()).recurrence(x, 5)
        torch.testing.assert_close(hf.decode_logits(x, 5, decode_mode="soft"), expected, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- generation
@pytest.mark.parametrize("mode,n", MODES, ids=[f"{m}{n or ''}" for m, n in MODES])
def test_generate_cached_equals_recomputed(mode, n):
    """Cached generation == generation recomputing everything without a cache (tokens and scores),
    for a left-padded batch of different prompt lengths generating beyond the window (W = 4), and
    every row equals generating it alone."""
    model = tiny_model(dtype=torch.float64)
    prompts = random_prompts([3, 7, 5])
    ids, mask = left_padded(prompts)
    cached = greedy(model, ids, mask, mode, n)
    fresh = greedy(model, ids, mask, mode, n, use_cache=False)
    assert torch.equal(cached.sequences, fresh.sequences)
    for a, b in zip(cached.logits, fresh.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert not any(torch.isnan(step).any() for step in cached.logits)
    generated = cached.sequences[:, ids.shape[1] :]
    assert len(set(generated.flatten().tolist())) > 3  # not a degenerate repetition
    for i, p in enumerate(prompts):
        alone = greedy(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), mode, n)
        assert torch.equal(alone.sequences[0, len(p) :], generated[i])
        for a, b in zip(alone.logits, cached.logits):
            torch.testing.assert_close(a[0], b[i], rtol=0, atol=1e-5)


def test_sliding_window_cache_keeps_only_the_window():
    """Windowed layers keep W−1 keys (a prefill longer than the window included); global layers all."""
    model = tiny_model()
    ids = torch.tensor(random_prompts([9])[0]).unsqueeze(0)
    out = greedy(model, ids, torch.ones_like(ids), "soft", 0, new_tokens=5)
    cache = out.past_key_values
    lengths = [layer.keys.shape[-2] for layer in cache.layers]
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert lengths[0] == lengths[2] == 3 and lengths[1] == lengths[3] >= 13


def test_soft_and_fused_equal_their_pass_definitions():
    """Soft generation's logits at the generated positions == forward(full sequence, k = T − p + 1
    passes, prefix p); fused(n)'s prefill logits == the (n+1)-pass forward over the prompt."""
    model = tiny_model(dtype=torch.float64)
    prompts = random_prompts([4, 6], seed=1)
    ids, mask = left_padded(prompts)
    p = ids.shape[1]
    soft = greedy(model, ids, mask, "soft", 0, new_tokens=6)
    seq = soft.sequences
    full_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - p, dtype=torch.long)], 1)
    real_prompt = mask.sum(1)  # prefix_len counts real tokens
    with torch.no_grad():
        k = seq.shape[1] - p + 1
        passes = model(seq, attention_mask=full_mask, num_passes=k, prefix_len=real_prompt, use_cache=False).logits
    for step, logits in enumerate(soft.logits):
        torch.testing.assert_close(logits, passes[:, p - 1 + step].float(), rtol=0, atol=1e-5)

    for n in (1, 2):
        fused = greedy(model, ids, mask, "fused", n, new_tokens=1)
        with torch.no_grad():
            expected = model(ids, attention_mask=mask, num_passes=n + 1, use_cache=False).logits[:, -1]
        torch.testing.assert_close(fused.logits[0], expected.float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode,n", MODES, ids=[f"{m}{n or ''}" for m, n in MODES])
def test_decode_logits_equal_generate(mode, n):
    """decode_logits(sequence, p) scores a generated sequence exactly as generate produced it."""
    model = tiny_model()
    ids = torch.tensor(random_prompts([5, 5], seed=2))
    out = greedy(model, ids, torch.ones_like(ids), mode, n, new_tokens=8)
    p = ids.shape[1]
    scored = model.decode_logits(out.sequences, p, decode_mode=mode, fused_prefill_passes=n)
    assert scored.shape == (2, out.sequences.shape[1], 256)
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(scored[:, p - 1 + step], logits, rtol=0, atol=1e-5)
    if mode == "fused":  # the prompt positions are the (n+1)-th pass
        with torch.no_grad():
            torch.testing.assert_close(scored[:, :p], model(ids, num_passes=n + 1).logits, rtol=0, atol=1e-5)


def test_config_defaults_and_refusals():
    model = tiny_model(decode_mode="fused", fused_prefill_passes=1)
    ids = torch.tensor(random_prompts([5], seed=3))
    default = greedy(model, ids, torch.ones_like(ids), None, None, new_tokens=3)
    explicit = greedy(model, ids, torch.ones_like(ids), "fused", 1, new_tokens=3)
    assert torch.equal(default.sequences, explicit.sequences)
    with pytest.raises(ValueError, match="greedy search and sampling only"):
        model.generate(ids, max_new_tokens=2, num_beams=2, decode_mode="soft")
    with pytest.raises(ValueError, match="decode_mode must be one of"):
        model.generate(ids, max_new_tokens=2, decode_mode="beam")
    for mode in ("standard", "soft"):
        with pytest.raises(ValueError, match="cache_implementation='static' is not supported: this model decodes with "
                                             "the dynamic cache"):
            model.generate(ids, max_new_tokens=2, decode_mode=mode, cache_implementation="static")
    baseline = tiny_model(latent_feedback=False)
    assert baseline.model.feedback is None
    # the one default: soft with latent feedback, standard for a baseline; a baseline cannot default to soft
    assert tiny_model().config.decode_mode == "soft" and baseline.config.decode_mode == "standard"
    with pytest.raises(Exception, match="decode_mode 'soft' needs latent feedback"):
        FBTConfig(**{**TINY, "latent_feedback": False, "decode_mode": "soft"})
    baseline.generate(ids, max_new_tokens=2, decode_mode="standard")
    with pytest.raises(ValueError, match="latent_feedback=False"):
        baseline.generate(ids, max_new_tokens=2, decode_mode="soft")
    # sampling works in soft mode
    torch.manual_seed(0)
    model.generate(ids, max_new_tokens=3, do_sample=True, decode_mode="soft")


def test_plain_transformers_api():
    """The usual causal-LM surface: base model, labels → loss, tuples, the past_key_values alias,
    a cache continued one token at a time."""
    from transformers import DynamicCache

    model = tiny_model()
    x = torch.tensor(random_prompts([9, 9], seed=5))
    with torch.no_grad():
        out = model(x, labels=x)
        base = model.model(x).last_hidden_state
        torch.testing.assert_close(model.lm_head(base), out.logits, rtol=0, atol=0)
        expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        torch.testing.assert_close(out.loss, expected)
        logits, cache = model(x, use_cache=True, return_dict=False)[:2]
        assert isinstance(cache, DynamicCache) and torch.equal(logits, out.logits)
        cache = DynamicCache(config=model.config)
        model(x[:, :5], past_key_values=cache)
        steps = [model(x[:, t : t + 1], past_key_values=cache).logits for t in range(5, 9)]
        torch.testing.assert_close(torch.cat(steps, 1), out.logits[:, 5:], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- export round trip
def test_save_and_load_as_remote_code(tmp_path, monkeypatch):
    """save_pretrained → the three .py files copied in → from_pretrained(trust_remote_code=True)
    offline gives identical logits (what exports do); lm_head is tied, not stored."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_model()
    model.config.auto_map = AUTO_MAP
    model.save_pretrained(tmp_path)
    for name in REMOTE_CODE:
        shutil.copy(HF_DIR / name, tmp_path / name)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "fbt" and saved["layer_types"] == model.config.layer_types
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.feedback.up_proj.weight" in f.keys()

    config = AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(config).__module__.startswith("transformers_modules")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(loaded).__module__.startswith("transformers_modules")
    x = torch.tensor(random_prompts([9, 9], seed=4))
    with torch.no_grad():
        for k in (1, 3):
            torch.testing.assert_close(loaded(x, num_passes=k).logits, model(x, num_passes=k).logits, rtol=0, atol=0)
    a, b = greedy(model, x, torch.ones_like(x), "fused", 1), greedy(loaded, x, torch.ones_like(x), "fused", 1)
    assert torch.equal(a.sequences, b.sequences)


def test_tokenizer_matches_sentencepiece(small_corpus, tmp_path, monkeypatch):
    """FBTTokenizer via AutoTokenizer from a folder encodes and decodes exactly as sentencepiece."""
    import sentencepiece
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_file = Path(small_corpus.tokenizer_path)
    shutil.copy(model_file, tmp_path / "tokenizer.model")
    shutil.copy(HF_DIR / "tokenization_fbt.py", tmp_path / "tokenization_fbt.py")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "FBTTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_fbt.FBTTokenizer", None]}}
    ))
    tok = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    assert (tok.eos_token_id, tok.pad_token_id) == (sp.eos_id(), sp.pad_id())

    docs = [json.loads(line)["text"] for path in sorted(model_file.parent.glob("docs.*.jsonl"))
            for line in path.read_text().splitlines()]
    lines = [line for doc in docs for line in doc.split("\n")][:400] + docs[:5] + ["a </s> <s> <pad>\t é ∑ 😀  \n"]
    assert len(lines) > 300
    for text in lines:
        ids = tok(text)["input_ids"]
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids) == text
    batch = tok(lines[:3], padding=True, return_tensors="pt")
    assert (batch["attention_mask"][:, 0] == 0).any() and tok.padding_side == "left"
