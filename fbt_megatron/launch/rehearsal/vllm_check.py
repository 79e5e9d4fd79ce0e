"""The rehearsal's vLLM child: an export served by vLLM's CPU engine (the plugin), greedy tokens.

    .venv-serve/bin/python -m fbt_megatron.launch.rehearsal.vllm_check --export DIR --prompt-ids IDS
        [--mode standard --mode soft --mode fused:2] [--max-new-tokens N]

One request per mode through ``LLM.generate`` (float32, eager, no chunked prefill, the mode in
``SamplingParams.extra_args`` as docs/serving.md shows); prints one JSON line: the engine's start-up
time and the generated tokens per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fbt_megatron.launch.rehearsal.vllm_check", description=__doc__.splitlines()[0])
    p.add_argument("--export", required=True)
    p.add_argument("--prompt-ids", required=True, help="the prompt as space-separated ids")
    p.add_argument("--mode", action="append", default=[], help="standard, soft or fused:N (repeat)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    args = p.parse_args(argv)
    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("TORCH_COMPILE_DISABLE", "1"), ("HF_HUB_OFFLINE", "1")):
        os.environ.setdefault(key, value)  # read by the engine's workers: before vLLM starts
    from vllm import LLM, SamplingParams

    ids = [int(x) for x in args.prompt_ids.split()]
    start = time.perf_counter()
    llm = LLM(model=args.export, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, enable_chunked_prefill=False,
              max_model_len=len(ids) + args.max_new_tokens, max_num_seqs=1, seed=0)
    started = time.perf_counter() - start
    tokens = {}
    for mode in args.mode or ["standard"]:
        name, _, n = mode.partition(":")
        extra = {"decode_mode": name, **({"fused_prefill_passes": int(n)} if n else {})}
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0, ignore_eos=True, extra_args=extra)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        tokens[mode] = list(out[0].outputs[0].token_ids)
    print(json.dumps({"start_seconds": started, "tokens": tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
