"""Serving benchmarks of an FBT export with vLLM: three ratios, each measured in one run.

    nice -n 19 python tools/serving_benchmark.py [--export EXPORT] [--repeats 3]

  soft / standard decode     output tokens/s of 16 concurrent soft requests over 16 standard ones
                             (goal >= 0.97: the fusion costs two d×d products per decoded token)
  vLLM / HF generate         output tokens/s of 32 requests of mixed lengths and modes in vLLM over
                             the HF export's ``generate``, one request at a time (goal >= 5)
  fused(n) / standard prefill  time of 16 prompts' prefill in fused(n) over standard
                             (goal <= (n + 1) × 1.05: n extra passes over the prompt)

Without ``--export`` a random export of ``--shape`` (fbt_megatron.serving.synthetic) is written to
a temporary folder. One engine (float32, eager, chunked prefill off) serves every row; each
measurement is the best of ``--repeats`` after a warm-up, the two sides of a ratio measured
alternately; prefix caching is off. Needs requirements-serve.txt.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = {
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, sliding_window=64, full_attention_every=2,
                  max_position_embeddings=1024),
    "tiny": {},
}


def prompts(lengths, vocab, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def best(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def paired(a, b, repeats):
    """Best times of ``a`` and ``b`` measured alternately (a shared machine's load hits both)."""
    a(), b()  # warm-up
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return min(ta), min(tb)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", default=None, help="an FBT export (default: a random one of --shape)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64, help="decoded tokens per request (default 64)")
    parser.add_argument("--fused-passes", type=int, default=2, help="n of fused(n) (default 2)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from fbt_megatron.serving.synthetic import write_export

    export = args.export or write_export(Path(tempfile.mkdtemp(prefix="fbt-bench-")) / "export", **SHAPES[args.shape])
    # no prefix caching: repeated prompts would skip the standard requests' prefill (soft/fused ones never read it)
    llm = LLM(model=str(export), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              enable_chunked_prefill=False, enable_prefix_caching=False, max_num_seqs=32, max_model_len=1024, seed=0)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    n = args.fused_passes
    modes = {"standard": {"decode_mode": "standard"}, "soft": {"decode_mode": "soft"},
             "fused": {"decode_mode": "fused", "fused_prefill_passes": n}}

    def generate(batch, mode_names, max_tokens):
        params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=modes[m])
                  for m in mode_names]
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    rows = []
    # 1. decode throughput, 16 concurrent requests
    batch = prompts([32] * 16, vocab, seed=1)
    tokens = 16 * args.new_tokens
    standard, soft = paired(lambda: generate(batch, ["standard"] * 16, args.new_tokens),
                            lambda: generate(batch, ["soft"] * 16, args.new_tokens), args.repeats)
    rows.append(("soft / standard decode throughput (16 concurrent)", (tokens / soft) / (tokens / standard), ">= 0.97",
                 f"{tokens / standard:,.0f} vs {tokens / soft:,.0f} tokens/s"))

    # 2. vLLM vs HF generate, 32 requests of mixed lengths and modes
    lengths = [8 + (37 * i) % 120 for i in range(32)]
    batch, names = prompts(lengths, vocab, seed=2), [("standard", "soft", "fused")[i % 3] for i in range(32)]
    new = 32
    vllm_time = best(lambda: generate(batch, names, new), args.repeats)
    hf = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).eval()

    def hf_generate():
        for p, m in zip(batch, names):
            hf.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                        decode_mode=m, fused_prefill_passes=n if m == "fused" else None)

    with torch.no_grad():
        hf_time = best(hf_generate, 1)
    rows.append(("vLLM / HF generate output tokens/s (32 mixed requests)", hf_time / vllm_time, ">= 5",
                 f"{32 * new / vllm_time:,.0f} vs {32 * new / hf_time:,.0f} tokens/s"))

    # 3. prefill, 16 prompts of 256 tokens (one generated token)
    batch = prompts([256] * 16, vocab, seed=3)
    standard, fused = paired(lambda: generate(batch, ["standard"] * 16, 1),
                             lambda: generate(batch, ["fused"] * 16, 1), args.repeats)
    rows.append((f"fused({n}) / standard prefill time (16 × 256 tokens)", fused / standard, f"<= {(n + 1) * 1.05:.2f}",
                 f"{standard * 1e3:,.0f} vs {fused * 1e3:,.0f} ms"))

    c = llm.llm_engine.model_config.hf_config
    print(f"\nexport: {export} (hidden {c.hidden_size}, {c.num_hidden_layers} layers, vocab {c.vocab_size}); "
          f"torch threads {torch.get_num_threads()}")
    print(f"| benchmark | ratio | goal | measured |\n|---|---|---|---|")
    for name, ratio, goal, detail in rows:
        print(f"| {name} | {ratio:.2f} | {goal} | {detail} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
