"""Generation (``fbt_megatron.generate``): the KV cache against recomputation, every decoding mode
against the training-time k-pass forward and the independent reference, sampling, and the CLI."""

import pytest
import torch
from forked import run_commands
from helpers import build, tokens
from megatron.core.inference.contexts import StaticInferenceContext
from reference import Reference

from fbt_megatron.evaluation.tasks.evaluate import pass_logits
from fbt_megatron.inference.generate import forced_logits, generate
from fbt_megatron.inference.generate.decoding import _Decoder
from fbt_megatron.model import fbt

WINDOWED = dict(sliding_window=4, full_attention_every=2)  # layers 1, 3: window 4; layers 2, 4: global
RAGGED = [[5, 17, 3, 99, 250, 7], [40, 41, 42], [900, 12, 13, 14, 15, 16, 17, 18, 19]]
MODES = {
    "standard": dict(mode="standard"),
    "soft": dict(mode="soft"),
    "fused2": dict(mode="fused", fused_passes=2),
    "adaptive": dict(mode="adaptive", tolerance=1e-2, max_passes=5),
    "adaptive_budget": dict(mode="adaptive", tolerance=1e-12, max_passes=3),  # always the budget: 3 passes
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return build(seed=3, **WINDOWED).eval()


def assert_logits_equal(a, b, atol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


@pytest.mark.parametrize("name", ["standard", "soft", "fused2", "adaptive"])
def test_cache_equals_recomputation(model, name):
    """Ragged prompts, generation beyond the window of 4: the KV cache gives the tokens and logits of
    recomputing the whole sequence at every position; so does teacher-forced decoding."""
    kw = MODES[name]
    cached = generate(model, RAGGED, max_new_tokens=10, return_logits=True, **kw)
    again = generate(model, RAGGED, max_new_tokens=10, return_logits=True, use_cache=False, **kw)
    assert cached.tokens == again.tokens and all(len(t) == 10 for t in cached.tokens)
    assert_logits_equal(cached.logits, again.logits)
    assert cached.prefill_passes == again.prefill_passes
    assert cached.prefill_passes == {"standard": 1, "soft": 1, "fused2": 3}.get(name, cached.prefill_passes)
    assert [x.shape for x in cached.logits] == [(10, model.config.vocab_size)] * 3

    continuations = [[1, 2, 3, 4, 5, 6, 7], [], [8, 9]]
    forced = forced_logits(model, RAGGED, continuations, **kw)
    assert [x.shape[0] for x in forced] == [8, 1, 3]
    assert_logits_equal(forced, forced_logits(model, RAGGED, continuations, use_cache=False, **kw))
    # feeding a sequence's own greedy tokens reproduces its logits
    own = forced_logits(model, RAGGED, [t[:-1] for t in cached.tokens], **kw)
    assert_logits_equal(own, cached.logits)


@pytest.mark.parametrize("name", ["standard", "soft", "fused2", "adaptive_budget"])
def test_ragged_batch_equals_each_sequence_alone(model, name):
    kw = MODES[name]
    batch = generate(model, RAGGED, max_new_tokens=8, return_logits=True, **kw)
    for i, prompt in enumerate(RAGGED):
        alone = generate(model, [prompt], max_new_tokens=8, return_logits=True, **kw)
        assert alone.tokens[0] == batch.tokens[i]
        assert_logits_equal(alone.logits, [batch.logits[i]])


@pytest.mark.parametrize("name", ["soft", "fused2", "adaptive"])
def test_edge_cases_cache_equals_recomputation(name):
    """One-token prompts beside long ones, a single new token, every layer global."""
    model = build(seed=8, sliding_window=None).eval()
    kw = MODES[name]
    for prompts, n in (([[5], [1, 2, 3, 4, 5, 6, 7]], 5), ([[9]], 3), (RAGGED, 1)):
        cached = generate(model, prompts, max_new_tokens=n, return_logits=True, **kw)
        again = generate(model, prompts, max_new_tokens=n, return_logits=True, use_cache=False, **kw)
        assert cached.tokens == again.tokens and cached.prefill_passes == again.prefill_passes
        assert_logits_equal(cached.logits, again.logits)


def k_pass_logits(model, inputs, prefix, num_passes):
    """The training-time k-pass forward (``fbt.run_pass``) with per-sequence prefix lengths."""
    feedback = lambda state, j: fbt.Feedback(state, fbt.fuse_mask(prefix, inputs.shape[1], state.device))  # noqa: E731
    state = None
    with torch.no_grad():
        for j in range(1, num_passes + 1):
            logits, state = fbt.run_pass(model, inputs, None, j, state, feedback)
    return logits, state


@pytest.mark.parametrize("feedback_state", ["residual", "final_norm"])
def test_soft_decoding_equals_k_pass_forward(feedback_state):
    """Soft decoding of prompts of length p generating n tokens == the k-pass forward with prefix p
    and k = T − p + 1 on the whole sequence (prompt + generated tokens fed, T = p + n − 1)."""
    model = build(seed=4, feedback_state=feedback_state, **WINDOWED).eval()
    prompts, n = RAGGED[:2], 7
    out = generate(model, prompts, mode="soft", max_new_tokens=n, return_logits=True)
    sequences = [p + g[:-1] for p, g in zip(prompts, out.tokens)]
    T = max(map(len, sequences))
    inputs = torch.tensor([s + [0] * (T - len(s)) for s in sequences])  # right padding: causal, never read
    prefix = torch.tensor([len(p) for p in prompts])
    logits, _ = k_pass_logits(model, inputs, prefix, T - int(prefix.min()) + 1)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(out.logits[i], logits[i, len(p) - 1 : len(p) - 1 + n], rtol=0, atol=1e-5)
    # the plain model differs: the feedback is used
    plain = generate(model, prompts, mode="standard", max_new_tokens=n, return_logits=True)
    assert (plain.logits[0][1:] - out.logits[0][1:]).abs().max() > 1e-3


def test_fused_prefill_equals_n_plus_1_pass_forward(model):
    """fused(n)'s prompt logits and carried states are the (n+1)-pass forward's on the prompt."""
    prompts = tokens(batch=2, seq=9, vocab=model.config.vocab_size, seed=5)  # [2, 10]: equal lengths
    for n in (0, 2):
        expected = list(pass_logits(model.eval(), prompts, n + 1))[-1][:, -1]
        got = forced_logits(model, prompts.tolist(), [[], []], mode="fused", fused_passes=n)
        torch.testing.assert_close(torch.stack([g[0] for g in got]), expected, rtol=0, atol=1e-5)
        _, state = k_pass_logits(model, prompts, torch.zeros(2, dtype=torch.long), n + 1)
        with torch.no_grad():
            _, states, _, _ = _Decoder(model, prompts.tolist(), [1, 1], "fused", n + 1, 0, 0, True)._prefill(10)
        torch.testing.assert_close(states[-1], state, rtol=0, atol=1e-5)


def reference_decoding(ref, prompt, continuation, prefill_passes):
    """fused(prefill_passes − 1) then soft decoding over a forced continuation, written directly on
    tests/reference.py: logits after the prompt and after each continuation token."""
    e = ref.embed(torch.tensor([prompt + continuation]))  # [1, T, h]
    p = len(prompt)
    x, fed = e[:, :p], None
    for _ in range(prefill_passes):
        if fed is not None:  # position 0 keeps e_0; t ≥ 1 takes fuse(s_{t−1}, e_t)
            x = torch.cat([e[:, :1], ref.fuse(fed[:, : p - 1], e[:, 1:p])], dim=1)
        logits, fed = ref.head(ref.stack(x))
    out, state = [logits[0, -1]], fed[:, -1]
    for t in range(p, e.shape[1]):
        x = torch.cat([x, ref.fuse(state, e[:, t])[:, None]], dim=1)
        logits, fed = ref.head(ref.stack(x))
        out.append(logits[0, -1])
        state = fed[:, -1]
    return torch.stack(out)


def test_fused_then_soft_equals_reference(model):
    ref = Reference(model.config, model.state_dict())
    prompts, continuations = RAGGED[:2], [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5]]
    got = forced_logits(model, prompts, continuations, mode="fused", fused_passes=2)
    for i in range(2):
        torch.testing.assert_close(got[i], reference_decoding(ref, prompts[i], continuations[i], 3), rtol=0, atol=1e-5)


def test_adaptive_pass_count(model):
    """Loose tolerance: 2 passes; unreachable tolerance: the budget; the result is fused(count − 1)'s."""
    prompts = RAGGED[:2]
    assert generate(model, prompts, mode="adaptive", tolerance=1e6, max_new_tokens=2).prefill_passes == 2
    budget = generate(model, prompts, mode="adaptive", tolerance=1e-12, max_passes=4, max_new_tokens=6,
                      return_logits=True)
    assert budget.prefill_passes == 4
    fused = generate(model, prompts, mode="fused", fused_passes=3, max_new_tokens=6, return_logits=True)
    assert budget.tokens == fused.tokens
    assert_logits_equal(budget.logits, fused.logits, atol=0)


def test_sampling(model):
    kw = dict(mode="soft", max_new_tokens=12)
    greedy = generate(model, RAGGED, **kw)
    assert generate(model, RAGGED, **kw).tokens == greedy.tokens
    sampled = generate(model, RAGGED, temperature=1.0, seed=5, **kw)
    assert generate(model, RAGGED, temperature=1.0, seed=5, **kw).tokens == sampled.tokens
    assert generate(model, RAGGED, temperature=1.0, seed=6, **kw).tokens != sampled.tokens
    assert sampled.tokens != greedy.tokens
    assert generate(model, RAGGED, temperature=1.0, seed=5, use_cache=False, **kw).tokens == sampled.tokens
    assert generate(model, RAGGED, temperature=1.0, top_p=1e-6, seed=5, **kw).tokens == greedy.tokens
    limited = generate(model, RAGGED, temperature=2.0, seed=5, vocab_size=10, **kw)
    assert all(0 <= x < 10 for seq in limited.tokens for x in seq)


def test_stop_tokens(model):
    kw = dict(mode="fused", fused_passes=1, max_new_tokens=12, return_logits=True)
    full = generate(model, RAGGED, **kw)
    stop = full.tokens[0][3]
    out = generate(model, RAGGED, stop_tokens=[stop], **kw)
    for seq, whole, logits in zip(out.tokens, full.tokens, out.logits):
        expected = whole[: whole.index(stop) + 1] if stop in whole else whole
        assert seq == expected and len(logits) == len(seq)
    assert len(out.tokens[0]) <= 4 and out.tokens[0][-1] == stop


@pytest.mark.parametrize("gate", [True, False])
def test_window_layers_cache_only_the_window(gate):
    """The model with megatron's StaticInferenceContext: a prefill then single positions give the
    full forward's logits; window layers hold W − 1 = 3 positions, global layers the whole length.
    One attention class serves both configurations, with the state-dict names of each (and the
    reference's results)."""
    model = build(seed=6, headwise_attention_gate=gate, **WINDOWED).eval()
    assert any("self_attention.linear_gate" in k for k in model.state_dict()) == gate
    x = tokens(batch=2, seq=11, vocab=model.config.vocab_size, seed=7)  # [2, 12]
    context = StaticInferenceContext(2, 12)
    with torch.no_grad():
        full, top = model(x)
        torch.testing.assert_close(full, Reference(model.config, model.state_dict()).forward(x)[0], rtol=0, atol=1e-5)
        logits, state = model(x[:, :6], inference_context=context)
        context.increment_sequence_len_offset(6)
        torch.testing.assert_close(logits[:, -1], full[:, 5], rtol=0, atol=1e-5)
        torch.testing.assert_close(state, top[:6], rtol=0, atol=1e-5)
        for t in range(6, 12):
            logits, state = model(x[:, t : t + 1], inference_context=context)
            context.increment_sequence_len_offset(1)
            torch.testing.assert_close(logits[:, -1], full[:, t], rtol=0, atol=1e-5)
            torch.testing.assert_close(state[0], top[t], rtol=0, atol=1e-5)
    lengths = {layer: k.shape[0] for layer, (k, v) in context.key_value_memory_dict.items()}
    assert lengths == {1: 3, 2: 12, 3: 3, 4: 12}


def test_bad_inputs(model):
    def error(**kw):
        args = dict(prompts=RAGGED, max_new_tokens=4)
        args.update(kw)
        with pytest.raises(ValueError) as e:
            generate(model, args.pop("prompts"), **args)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "unknown mode" in error(mode="greedy")
    assert "fused_passes" in error(mode="fused", fused_passes=-1)
    assert "empty" in error(prompts=[[1, 2], []])
    assert "no prompts" in error(prompts=[])
    assert "maximum length" in error(prompts=[[1] * 126], max_new_tokens=3)
    assert "vocabulary" in error(prompts=[[model.config.vocab_size]])
    assert "top_p" in error(top_p=0.0)
    with pytest.raises(ValueError, match="latent feedback"):
        generate(build(latent_feedback=False), [[1]], mode="soft")
    # RoPE goes beyond the training length: a larger max_length allows it
    beyond = generate(model, [[1] * 126], max_new_tokens=4, max_length=130, mode="soft", return_logits=True)
    assert_logits_equal(beyond.logits, generate(model, [[1] * 126], max_new_tokens=4, max_length=130, mode="soft",
                                                return_logits=True, use_cache=False).logits)
    with pytest.raises(ValueError, match="continuations"):
        forced_logits(model, RAGGED, [[1]])


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory, tiny_run, tiny_baseline_run):
    """4-step FBT and baseline runs of the tiny CPU recipes, and a folder for logs."""
    return {"fbt": str(tiny_run), "baseline": str(tiny_baseline_run)}, tmp_path_factory.mktemp("generate")


@pytest.mark.slow
def test_cli(trained_runs):
    runs, folder = trained_runs
    commands = [
        ("--load", runs["fbt"], "--prompt", "def f(", "--prompt", "import os\nclass A:", "--mode", "soft",
         "--max-new-tokens", 8, "--ckpt-step", 4, "--threads", 1),
        ("--load", runs["fbt"], "--prompt", "def f(", "--mode", "fused", "--fused-passes", 2, "--temperature", 0.8,
         "--top-p", 0.9, "--seed", 1, "--max-new-tokens", 4),
        ("--load", runs["fbt"], "--prompt-ids", "5 6 7", "--mode", "adaptive", "--tolerance", "1e-3", "--max-passes", 3,
         "--max-new-tokens", 2),
    ]
    refused = [
        (("--load", str(folder / "missing"), "--prompt", "x"), "no such run folder"),
        (("--load", runs["fbt"], "--prompt", "x", "--mode", "beam"), "unknown mode"),
        (("--load", runs["baseline"], "--prompt", "x", "--mode", "soft"),
         "--mode soft needs latent feedback, and this model has none (latent_feedback false): use --mode standard"),
        (("--load", runs["fbt"], "--prompt", "x", "--top-p", "0"), "--top-p must be in (0, 1], got 0.0"),  # flags, not
        (("--load", runs["fbt"], "--prompt", "x", "--max-new-tokens", "0"), "--max-new-tokens must be >= 1, got 0"),  # arguments
    ]
    logs = [folder / f"generate{i}.log" for i in range(len(commands) + len(refused))]
    codes = run_commands("fbt_megatron.generate",
                         [(list(map(str, args)), log, None) for args, log in zip([*commands, *(a for a, _ in refused)], logs)])
    (soft, fused, adaptive), outs = codes[:3], [log.read_text() for log in logs]
    assert soft == 0, outs[0]
    assert "# mode soft: 1 prefill pass; greedy" in outs[0] and "--- 2 (" in outs[0]
    body = outs[0].split("--- 1 (")[1]
    assert body.split("\n", 1)[1].startswith("def f(")  # the prompt, then its continuation
    assert fused == 0 and "# mode fused(2): 3 prefill passes; temperature 0.8, top-p 0.9, seed 1" in outs[1], outs[1]
    assert adaptive == 0, outs[2]
    assert "prefill passes used (tolerance 0.001, at most 3)" in outs[2] or "prefill pass used" in outs[2]
    for (_, message), code, out in zip(refused, codes[3:], outs[3:]):
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and message in errors[0], out
