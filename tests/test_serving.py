"""Serving FBT exports with vLLM (``fbt_megatron.inference.serving``), on CPU with a real engine.

Every output is checked against the HF export's own code (``generate`` / ``decode_logits`` of
``modeling_fbt.py`` loaded with ``trust_remote_code``): greedy tokens equal token for token and
log-probabilities within 1e-4, for batches mixing standard, soft and fused(2) requests of prompt
lengths 3 … 40 past the sliding window (16), both feedback sources, under continuous batching with
a KV cache small enough to preempt, chunked prefill (on an engine whose default mode
``--hf-overrides`` sets), prefix caching, 100 requests through 4 slots, ``vllm serve`` (docs/serving.md's
command) with the ``openai`` client, completions and a chat with the SFT export of
recipes/sft_tiny_cpu.yaml, and lm-eval's vLLM backend against the HF ``fbt`` model. The refusals a
client meets (a bad mode or key, beam search in soft, a head dimension vLLM cannot attend with) are
one message each.

Every offline equality test runs twice: on engines with vLLM's default compilation (torch.compile
of the model's pass) and with ``enforce_eager``; the server runs docs/serving.md's command (compiled),
lm-eval its backend's default (eager). Engine starts are few (~15 s on an idle machine, plus ~30 s
the first time a shape compiles): one offline engine per feedback source and mode, one server, one
lm-eval engine. The module is skipped only when vLLM is not installed
(``pip install -r requirements-serve.txt``); CI installs it and sets FBT_REQUIRE_VLLM=1, which
turns the skip into a failure.
"""

import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("FBT_REQUIRE_VLLM") == "1":
        raise RuntimeError("FBT_REQUIRE_VLLM=1 but vllm is not installed: pip install -r requirements-serve.txt")
    pytest.skip("vllm is not installed (pip install -r requirements-serve.txt; see docs/serving.md)",
                allow_module_level=True)

# the engine's workers (spawned processes) read these
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # LLM.apply_model: inspect the state buffer
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fbt_megatron.inference.serving.synthetic import write_export  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = (3, 9, 17, 26, 33, 40)  # prompts around and past the sliding window (16)
MODES = ({"decode_mode": "standard"}, {"decode_mode": "soft"}, {"decode_mode": "fused", "fused_prefill_passes": 2})
NEW = 12
TOL = 1e-4


def prompts(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def mixed(lengths=LENGTHS, modes=MODES, seed=0):
    """[(prompt, mode)]: every length in every mode."""
    return [(p, m) for p in prompts(lengths, seed) for m in modes]


def engine(export, compilation, **kwargs):
    """An offline engine; ``compilation``: "compiled" (vLLM's default: the one-pass step through
    torch.compile) or "eager" (``enforce_eager``)."""
    from vllm import LLM

    args = dict(model=str(export), skip_tokenizer_init=True, dtype="float32", enforce_eager=compilation == "eager",
                max_model_len=128, max_num_seqs=4, enable_chunked_prefill=False, seed=0)
    return LLM(**{**args, **kwargs})


def run(llm, requests, max_tokens=NEW, **extra):
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1, ignore_eos=True, extra_args=dict(m), **extra)
              for _, m in requests]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def state_of(llm) -> dict:
    """The worker's state buffer: slots in use, its shape and address, the step counters."""
    from fbt_megatron.inference.serving.state import summary

    return llm.apply_model(summary)[0]


class Reference:
    """The HF export (its own remote code), greedy generation and decode_logits per request."""

    def __init__(self, export):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).eval()
        self.memo = {}

    def generate(self, prompt, mode, max_tokens=NEW):
        key = (tuple(prompt), json.dumps(mode, sort_keys=True), max_tokens)
        if key not in self.memo:
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                      decode_mode=mode["decode_mode"], fused_prefill_passes=mode.get("fused_prefill_passes"),
                                      output_logits=True, return_dict_in_generate=True, eos_token_id=None)
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, tokens)]
            self.memo[key] = (tokens, logprobs)
        return self.memo[key]

    def logprobs(self, ids, prompt_length, mode):
        """log P(ids[t] | ids[:t]) for t = 1 … T−1 as decode_logits scores them."""
        with torch.no_grad():
            logits = self.model.decode_logits(torch.tensor([ids]), prompt_length, decode_mode=mode["decode_mode"],
                                              fused_prefill_passes=mode.get("fused_prefill_passes"))
        lp = torch.log_softmax(logits[0].double(), -1)
        return [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]


def assert_equal(reference, requests, outputs, what):
    """Tokens equal, log-probabilities within TOL; returns the largest difference."""
    worst = 0.0
    for (prompt, mode), (tokens, logprobs) in zip(requests, outputs):
        ref_tokens, ref_logprobs = reference.generate(prompt, mode, len(tokens))
        assert tokens == ref_tokens, f"{what}: {mode} prompt of {len(prompt)}: vLLM {tokens} != HF {ref_tokens}"
        worst = max(worst, max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)))
    assert worst < TOL, f"{what}: largest |logprob difference| {worst:.2e}"
    print(f"{what}: {len(requests)} requests equal, largest |Δ logprob| = {worst:.1e}")
    return worst


# ---------------------------------------------------------------- exports and engines
@pytest.fixture(scope="module")
def exports(tmp_path_factory, small_corpus):
    """Two tiny exports (head_dim 32, window 16, float32): the paper's (residual feedback, with the
    corpus's sentencepiece tokenizer) and the variant (final-norm feedback, no sandwich norms)."""
    base = tmp_path_factory.mktemp("serving")
    return {
        "residual": write_export(base / "residual", seed=1, tokenizer_model=small_corpus.tokenizer_path,
                                 max_position_embeddings=512),
        "final_norm": write_export(base / "final_norm", seed=2, feedback_source="final_norm", sandwich_norm=False),
    }


@pytest.fixture(scope="module")
def reference(exports):
    return Reference(exports["residual"])


@pytest.fixture(scope="module", params=["compiled", "eager"])
def compilation(request):
    """Every offline equality test runs on a compiled engine (vLLM's default) and an eager one."""
    return request.param


@pytest.fixture(scope="module")
def llm(exports, compilation):
    """The residual export: no chunked prefill, 4 sequences at a time, and a KV cache of 16 blocks of
    32 tokens (about 85 tokens of every layer: running requests that grow past a block get preempted)."""
    llm = engine(exports["residual"], compilation, block_size=32, num_gpu_blocks_override=16, max_model_len=64)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_mixed_modes_batching_and_preemption_equal_hf(llm, reference, compilation):
    """18 requests (6 lengths × standard/soft/fused(2), 24 new tokens each) submitted together through
    4 slots and a KV cache that preempts: every one equals HF's generate, and the fed-back states were recomputed
    exactly after preemption (which the test checks happened)."""
    requests = mixed()
    before = state_of(llm)
    assert before["compiled"] == (compilation == "compiled")  # vLLM compiles the model's pass unless eager
    outputs = run(llm, requests, max_tokens=24)  # prompts of up to 40 grow to 64 tokens
    assert_equal(reference, requests, outputs, "batching + preemption (residual)")
    after = state_of(llm)
    assert after["preempted"] > before["preempted"], "the KV cache was meant to force preemption"
    assert after["max_passes"] >= 3  # fused(2) prefills ran 3 passes
    assert after["in_use"] == 0 and after["shape"] == before["shape"] and after["address"] == before["address"]


def test_prompt_logprobs_equal_decode_logits(llm, reference):
    """Scoring: prompt log-probabilities with a context length per request equal decode_logits."""
    from vllm import SamplingParams

    ids = prompts([30], seed=3)[0]
    worst = 0.0
    for mode in MODES:
        for length in (1, 12, 30):
            params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0,
                                    extra_args={**mode, "prompt_length": length})
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            got = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
            expected = reference.logprobs(ids, length, mode)
            worst = max(worst, max(abs(a - b) for a, b in zip(got, expected)))
    assert worst < TOL
    print(f"prompt logprobs = decode_logits: largest |Δ| = {worst:.1e}")


def test_prefix_caching_never_reuses_fed_back_kv(llm, reference):
    """Prefix caching is on: a second request whose prompt holds the first one's soft output (and a
    third that shares only its prompt) equal HF, in every mode."""
    first = [(prompts([20], seed=4)[0], {"decode_mode": "soft"})]
    out = run(llm, first, max_tokens=20)
    assert_equal(reference, first, out, "prefix caching: the first")
    tokens = out[0][0]
    follow = first[0][0] + tokens + prompts([3], seed=5)[0]
    shared = first[0][0] + prompts([9], seed=6)[0]
    requests = [(p, m) for p in (follow, shared) for m in MODES]
    assert_equal(reference, requests, run(llm, requests), "prefix caching: continuations")


def test_many_requests_leave_no_state(llm, reference):
    """100 requests of random lengths and modes through 4 slots: every output equals the request
    generated alone, all slots are free afterwards and the buffer neither grew nor moved."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(3, 41, (100,), generator=g).tolist()
    modes = [MODES[i] for i in torch.randint(0, 3, (100,), generator=g).tolist()]
    requests = list(zip(prompts(lengths, seed=8), modes))
    before = state_of(llm)
    outputs = run(llm, requests, max_tokens=6)
    assert_equal(reference, requests, outputs, "100 requests")
    after = state_of(llm)
    assert after["in_use"] == 0 and after["shape"] == before["shape"] == (5, 64)
    assert after["address"] == before["address"]


def test_bad_mode_is_that_requests_error(llm, reference):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    ids = prompts([6], seed=9)[0]
    for bad, message in (({"decode_mode": "beam"}, "unknown decode mode 'beam'"),
                         ({"decode_mod": "soft"}, "unknown vllm_xargs key 'decode_mod': an FBT request takes decode_mode"),
                         ({"decode_mode": "soft", "fused_prefill_passes": 2}, "needs decode_mode=fused"),
                         ({"decode_mode": "soft", "prompt_length": 0}, "prompt_length must be a positive integer")):
        with pytest.raises(VLLMValidationError, match=message):
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, extra_args=bad), use_tqdm=False)
    from vllm.sampling_params import BeamSearchParams

    with pytest.raises(ValueError, match="beam search decodes in standard mode only.*this request's mode is soft: start "
                                         "the engine with hf_overrides"):
        llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert_equal(reference, [(ids, MODES[1])], run(llm, [(ids, MODES[1])]), "after refusals")
    # the one default: a request that names no mode decodes soft (which differs from standard here)
    plain = prompts([26, 33], seed=9)
    assert any(reference.generate(p, MODES[0])[0] != reference.generate(p, MODES[1])[0] for p in plain)
    assert_equal(reference, [(p, MODES[1]) for p in plain], run(llm, [(p, {}) for p in plain]), "no mode: soft")


def test_state_plan_entries_against_the_rows():
    """The state's plan, without an engine: each step's index entries equal what its rows say
    (computed here from the rows); a decode step's entries are kept for the next decode step of the
    same requests and cleared before any other step, a forward without a plan, or after a refused
    step; the values a token reads are W_U of its slot's state."""
    import numpy as np

    from fbt_megatron.inference.serving.requests import RequestMode
    from fbt_megatron.inference.serving.state import FeedbackState, Rows

    hidden, soft = 8, RequestMode("soft", 0)
    state = FeedbackState(4, 16, hidden, torch.float32, "cpu")
    weight = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0))
    project = lambda states, out: torch.mm(states, weight.t(), out=out)  # noqa: E731

    def rows(ids, start, end, t0, decode):
        return Rows(ids, [soft] * len(ids), np.array(start), np.array(end), np.array(t0), np.array([3] * len(ids)), decode)

    def entries(n):
        return (state.token_reads[:n, 0].tolist(), state.token_write[:n].tolist(), state.token_source[:n].tolist())

    neutral = lambda n: ([False] * n, [0] * n)  # noqa: E731
    # a prefill step: a standard request (tokens 0-2) and two soft ones (3-5, 6-8), no reads
    ids = ["a", "b"]
    plan = state.prepare(9, rows(ids, [3, 6], [6, 9], [0, 0], False))
    reads, writes, _ = entries(9)
    assert plan.gathered == 0 and not any(reads) and writes == [0, 0, 0, 0, 0, 1, 0, 0, 2]
    state.buffer[1:3] = torch.randn(2, hidden)
    state.finish()
    assert entries(9)[:2] == neutral(9)
    # decode steps: one token per request, the soft ones read and write their slots
    decode = ["a", "b"]
    for t0 in (3, 4):
        plan = state.prepare(3, rows(decode, [1, 2], [2, 3], [t0, t0], True))
        state.gather(project)
        reads, writes, source = entries(3)
        assert (reads, writes, source[1:]) == ([False, True, True], [0, 1, 2], [1, 2]) and plan.gathered == 3
        read = state.values.index_select(0, state.token_source[:3])[1:]
        torch.testing.assert_close(read, state.buffer[1:3] @ weight.t())
        state.finish()
        assert entries(3)[:2] == ([False, True, True], [0, 1, 2])  # kept for the next decode step
    assert state._position[1:3].tolist() == [4, 4]
    state.neutral()  # what a forward without a plan does first
    assert entries(3)[:2] == neutral(3)
    plan = state.prepare(3, rows(decode, [1, 2], [2, 3], [5, 5], True))
    assert entries(3)[:2] == ([False, True, True], [0, 1, 2])
    state.finish()
    state.prepare(1, None)  # a step of standard requests only clears the kept entries
    assert entries(3)[:2] == neutral(3)
    state.finish()
    # a step whose positions skip one is refused in one line, and leaves the tensors neutral
    state.prepare(3, rows(decode, [1, 2], [2, 3], [6, 6], True))
    state.finish()
    with pytest.raises(RuntimeError, match="request a: the fed-back state is of position 6, position 8 needs 7's"):
        state.prepare(3, rows(decode, [1, 2], [2, 3], [8, 7], True))
    assert entries(3)[:2] == neutral(3) and state.plan is None
    # a freed slot moves the layout's slots: b's next decode step is written anew
    state.release(["a"])
    plan = state.prepare(2, rows(["b"], [1], [2], [7], True))
    assert entries(2)[:2] == ([False, True], [0, 2]) and plan.gathered == 3


def test_soft_on_a_baseline_is_refused_at_admission():
    """The admission check of a baseline export's engine (latent_feedback false)."""
    from vllm import SamplingParams

    from fbt_megatron.inference.serving import engine as engine_module
    from fbt_megatron.inference.serving.requests import FBTRequests

    saved = engine_module._CURRENT
    engine_module._CURRENT = engine_module.ExportDefaults(False, "standard", 0, False)
    try:
        with pytest.raises(ValueError, match="needs latent feedback; this export has none"):
            FBTRequests.validate_params(SamplingParams(extra_args={"decode_mode": "soft"}))
        params = SamplingParams()
        FBTRequests.validate_params(params)
        assert params.extra_args == {"decode_mode": "standard", "fused_prefill_passes": 0}
    finally:
        engine_module._CURRENT = saved


def test_chunked_prefill_final_norm_feedback_and_hf_overrides(llm, exports, compilation):
    """The final-norm export with chunked prefill and a 16-token budget: prompts of up to 40
    tokens arrive in chunks; standard and soft equal HF; fused(n) is refused in one line (it needs
    the whole prompt in one step) and the engine keeps serving. The same engine is started with
    ``hf_overrides={"decode_mode": "standard"}`` (``--hf-overrides``): requests that name no mode decode
    standard, requests that name soft stay soft."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    llm.llm_engine.engine_core.shutdown()  # one engine at a time on the 2-core machine
    chunked = engine(exports["final_norm"], compilation, enable_chunked_prefill=True, max_num_batched_tokens=16,
                     hf_overrides={"decode_mode": "standard"})
    try:
        reference = Reference(exports["final_norm"])
        requests = mixed(modes=MODES[:2], seed=10)
        assert_equal(reference, requests, run(chunked, requests), "chunked prefill (final_norm)")
        # the overridden default: no decode_mode is standard (which differs from soft for these prompts)
        plain = [p for p, _ in requests[::2]]
        assert any(reference.generate(p, MODES[0])[0] != reference.generate(p, MODES[1])[0] for p in plain)
        assert_equal(reference, [(p, MODES[0]) for p in plain], run(chunked, [(p, {}) for p in plain]),
                     "--hf-overrides decode_mode=standard")
        with pytest.raises(VLLMValidationError, match="needs the whole prompt in one step.*--no-enable-chunked-prefill"):
            chunked.generate([{"prompt_token_ids": requests[0][0]}], SamplingParams(extra_args=MODES[2]), use_tqdm=False)
        assert_equal(reference, requests[:2], run(chunked, requests[:2]), "chunked prefill after a refusal")
        assert state_of(chunked)["in_use"] == 0
    finally:
        chunked.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------- the OpenAI server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sft_export(tmp_path_factory, small_corpus):
    """(export, the SFT set's tokenizer file): recipes/sft_tiny_cpu.yaml trained 4 steps from scratch
    on the small corpus's SFT set with heads of 32 (the tiny preset's 16 is not a size vLLM's CPU
    attention takes), exported with its chat template."""
    from forked import run_commands

    from fbt_megatron.data.sft.tiny_set import set_files
    from fbt_megatron.inference.convert.to_hf import export

    base = tmp_path_factory.mktemp("sft")
    args = ["--recipe", ROOT / "recipes" / "sft_tiny_cpu.yaml", "--threads", "1", "--pretrained-checkpoint", "null",
            "--load", "null", "--save", base / "run", "--tokenizer-model", small_corpus.tokenizer_path,
            "--data-path", base / "set", "--corpus", f"sft:{small_corpus.source}", "--kv-channels", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--eval-interval", "4",
            "--eval-iters", "1", "--lr-warmup-iters", "1"]
    assert run_commands("fbt_megatron.train", [(args, base / "train.log", None)]) == [0], (base / "train.log").read_text()[-3000:]
    return export(str(base / "run"), str(base / "export"), say=lambda _: None), set_files(base / "set")[2]


def docs_serve_command(export) -> list:
    """The ``vllm serve`` command of docs/serving.md for ``export``."""
    line = next(line for line in (ROOT / "docs" / "serving.md").read_text().splitlines()
                if line.startswith("vllm serve EXPORT "))
    return shlex.split(line.replace("EXPORT", str(export)))


def test_openai_server_in_every_mode_and_chat(sft_export, tmp_path):
    """docs/serving.md's ``vllm serve`` command (without VLLM_CPU_KVCACHE_SPACE) on an SFT export and
    the ``openai`` client: completions in each mode (``vllm_xargs``) equal HF's generate; a chat
    completion (the export's chat template, default mode) equals HF's generate on the templated
    prompt, which is the prompt SFT trained on; a bad mode, an unknown key and beam search in soft
    are HTTP 400s with one message each and the server keeps serving; beam search in standard is served."""
    import openai
    from transformers import AutoTokenizer

    from fbt_megatron.data.sft.chat import ChatEncoder, chat_template
    from fbt_megatron.data.tokenizer import load_tokenizer

    export, tokenizer_file = sft_export
    reference = Reference(export)
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    cmd = [str(Path(sys.executable).parent / "vllm"), *docs_serve_command(export)[1:], "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # the command sizes its KV cache
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        deadline = time.monotonic() + 900
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "vllm serve did not start in 15 minutes"
                time.sleep(2)
        requests = mixed(lengths=(5, 24), seed=11)
        outputs = []
        for prompt, mode in requests:
            out = client.completions.create(model="fbt", prompt=prompt, max_tokens=NEW, temperature=0, logprobs=1,
                                            extra_body={"vllm_xargs": mode, "return_token_ids": True, "ignore_eos": True})
            choice = out.choices[0]
            outputs.append((list(choice.token_ids), list(choice.logprobs.token_logprobs)))
        assert_equal(reference, requests, outputs, "vllm serve + openai")

        # chat: the template SFT trained with, in the export's tokenizer files; the default mode (soft)
        messages = [{"role": "user", "content": "What does json.loads do?"}]
        encoder = ChatEncoder(load_tokenizer(tokenizer_file), *chat_template(tokenizer_file))
        prompt = AutoTokenizer.from_pretrained(export, trust_remote_code=True).apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False)
        assert prompt == encoder.tokens(encoder.render(messages, add_generation_prompt=True))
        chat = client.chat.completions.create(model="fbt", messages=messages, max_tokens=NEW, temperature=0,
                                              extra_body={"return_token_ids": True})
        expected = reference.generate(prompt, {"decode_mode": "soft"})[0]
        eos = reference.model.config.eos_token_id
        expected = expected[: expected.index(eos) + 1] if eos in expected else expected
        assert list(chat.prompt_token_ids) == prompt and list(chat.choices[0].token_ids) == expected, (chat, expected)
        answer = encoder.tokenizer.detokenize([t for t in expected if t != eos])
        assert chat.choices[0].message.content == answer
        print(f"chat: {messages} -> {answer!r} (tokens {expected}) = HF generate")

        refusals = (({"vllm_xargs": {"decode_mode": "beam"}}, "unknown decode mode 'beam'"),
                    ({"vllm_xargs": {"decode_mod": "soft"}}, "unknown vllm_xargs key 'decode_mod': an FBT request takes "
                                                             "decode_mode, fused_prefill_passes, prompt_length"),
                    ({"use_beam_search": True}, "beam search decodes in standard mode only"),
                    ({"use_beam_search": True, "vllm_xargs": {"decode_mode": "fused", "fused_prefill_passes": 2}},
                     "this request's mode is fused(2)"),
                    ({"use_beam_search": True, "vllm_xargs": {"decode_mode": "beam"}}, "unknown decode mode 'beam'"))
        for body, message in refusals:
            with pytest.raises(openai.BadRequestError) as refused:
                client.completions.create(model="fbt", prompt=requests[0][0], max_tokens=2, n=2 if "use_beam_search" in body else 1,
                                          extra_body=body)
            assert refused.value.status_code == 400 and message in str(refused.value), str(refused.value)
            print(f"HTTP 400: {refused.value.body['message'] if isinstance(refused.value.body, dict) else refused.value}")
        beams = client.completions.create(model="fbt", prompt=requests[0][0], max_tokens=3, n=2, temperature=0,
                                          extra_body={"use_beam_search": True, "vllm_xargs": {"decode_mode": "standard"}})
        assert len(beams.choices) == 2
        again = client.completions.create(model="fbt", prompt=requests[1][0], max_tokens=NEW, temperature=0,
                                          extra_body={"vllm_xargs": requests[1][1], "return_token_ids": True,
                                                      "ignore_eos": True})
        assert list(again.choices[0].token_ids) == outputs[1][0]
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_an_export_vllm_cannot_attend_is_refused_in_one_line(tmp_path):
    """Head dimension 16 (the tiny preset's): ``vllm serve`` stops before it starts, with one
    ``error:`` line and exit code 2 (it used to start and die on the first request)."""
    export = write_export(tmp_path / "hd16", head_dim=16)
    run = subprocess.run([str(Path(sys.executable).parent / "vllm"), "serve", str(export), "--dtype", "float32",
                          "--port", str(free_port())], capture_output=True, text=True, timeout=600, cwd=ROOT)
    errors = [line for line in run.stderr.splitlines() if "Traceback" in line or line.startswith("error:")]
    assert run.returncode == 2 and errors == [
        "error: this export's head_dim 16 is not one vLLM's CPU attention takes (32, 64, 80, 96, 112, 128, 160, 192, "
        "224, 256, 512): export a model trained with one of these (--kv-channels)"], run.stderr[-3000:]
    assert "Starting vLLM" not in run.stdout + run.stderr and "Application startup complete" not in run.stdout + run.stderr


# ---------------------------------------------------------------- lm-eval on vLLM
def test_lm_eval_vllm_backend_equals_hf(exports, tmp_path):
    """lm-eval's ``fbt-vllm`` model on the local tasks' text: per item, standard equals the HF
    ``fbt`` model in standard (= lm-eval's ``hf``) within 1e-4; soft and fused(2) equal ``fbt`` in
    those modes within 1e-4 or 2e-5 per continuation token (a sum of float32 log-probabilities fed
    back through up to 42 steps; the engine here is eager, whose norms are vLLM's CPU kernels, which
    sum in another order than torch's: 4.5e-4 on a 42-token fused(2) continuation with them, 3.7e-4
    with vLLM's native norm); ``harness.ExportEvaluator(backend="vllm")`` evaluates the tasks."""
    from fbt_megatron.evaluation.harness import ExportEvaluator, table_row
    from fbt_megatron.evaluation.lm import FBTLM
    from fbt_megatron.evaluation.local_tasks import build_tasks
    from fbt_megatron.evaluation.vllm_lm import FBTVLLM

    export = str(exports["residual"])
    tasks = build_tasks(str(tmp_path / "tasks"), documents=4, questions=8, max_chars=300)
    hf = FBTLM(pretrained=export, batch_size=8)
    vl = FBTVLLM(pretrained=export, batch_size=8, max_model_len=512, max_num_seqs=8, seed=0)
    items = [json.loads(line) for line in (Path(tasks.folder) / "next_line.jsonl").read_text().splitlines()]
    requests = [((i["context"], c), *hf._encode_pair(i["context"], c)) for i in items[:4] for c in i["choices"]]
    docs = [json.loads(line)["text"] for line in (Path(tasks.folder) / "perplexity.jsonl").read_text().splitlines()]
    requests += [((None, d), [hf.prefix_token_id], hf.tok_encode(d)[:24]) for d in docs[:2]]  # a rolling window
    worst = {}
    for mode, passes in (("standard", 0), ("soft", 0), ("fused", 2)):
        for lm in (hf, vl):
            lm.decode_mode, lm.fused_prefill_passes = mode, passes
        a, b = hf._loglikelihood_tokens(requests), vl._loglikelihood_tokens(requests)
        diffs = [abs(x[0] - y[0]) for x, y in zip(a, b)]
        worst[mode] = max(diffs)
        print(mode, "per-item |Δ|:", " ".join(f"{d:.1e}" for d in diffs),
              "continuation lengths:", [len(r[2]) for r in requests])
        assert all(x[1] == y[1] for x, y in zip(a, b)), mode
        for d, (_, _, continuation) in zip(diffs, requests):
            assert d < (TOL if mode == "standard" else max(TOL, 2e-5 * len(continuation))), (mode, d, len(continuation))
    print(f"lm-eval vLLM vs HF, largest |Δ loglikelihood| per item: {worst}")
    evaluator = ExportEvaluator(export, lm=vl, backend="vllm")
    row = table_row(evaluator.evaluate("fused(2)", tasks, limit=4))
    assert 0 <= row["acc"] <= 1 and row["word_perplexity"] > 1


def test_evaluation_backend_flag():
    from fbt_megatron.evaluation.__main__ import _backend

    assert _backend(["run", "--model", "fbt", "--backend", "vllm"]) == (["run", "--model", "fbt-vllm"], "vllm")
    assert _backend(["run", "--backend=vllm"]) == (["run", "--model", "fbt-vllm"], "vllm")
    assert _backend(["run", "--model", "fbt"]) == (["run", "--model", "fbt"], "hf")
    with pytest.raises(ValueError, match="choose hf or vllm"):
        _backend(["--backend", "tpu"])


def test_serving_benchmark_runs_end_to_end(tmp_path):
    """``tools/benchmark.py --serving``, one round of short calls (its timing goals are not tested):
    the engines of each compilation in their host process, every ratio in the JSON, the report alone
    on stdout (vLLM's log lines go to stderr)."""
    out = tmp_path / "serving.json"
    done = subprocess.run([sys.executable, "tools/benchmark.py", "--serving", "--repeats", "1", "--warmup", "0",
                           "--new-tokens", "4", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    ratios = json.loads(out.read_text())["ratios"]
    modes = ("standard", "soft")
    compilations = ("compiled", "eager")
    assert set(ratios) == {
        *(f"serving_decode_{m}_vs_qwen3_{c}" for m in modes for c in compilations),
        *(f"serving_decode_global_standard_vs_qwen3_{c}" for c in compilations),
        *(f"serving_decode_{m}_vs_gemma3_{c}" for m in modes for c in compilations),
        *(f"serving_decode_gemma3_vs_qwen3_{c}" for c in compilations),
        *(f"serving_decode_qwen3_layer_{m}_vs_qwen3_{c}" for m in modes for c in compilations),
        *(f"serving_decode_throughput_soft_vs_standard_{c}" for c in compilations),
        *(f"serving_prefill_time_fused2_vs_standard_{c}" for c in compilations),
        "serving_generate_vllm_vs_hf"}
    for key, r in ratios.items():
        assert r["value"] > 0 and r["status"] in {"PASS", "MISS", "info"}, (key, r)
    assert "FBT with Qwen3's layer" in done.stdout and "INFO" not in done.stdout, done.stdout[-2000:]
