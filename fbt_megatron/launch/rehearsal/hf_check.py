"""The rehearsal's Hugging Face child: an export loaded offline by transformers, greedy tokens.

    python -m fbt_megatron.launch.rehearsal.hf_check --export DIR --prompt TEXT --prompt-ids IDS
        [--mode standard --mode soft --mode fused:2] [--max-new-tokens N]

Loads ``DIR`` with ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`` in float32
and its tokenizer with ``AutoTokenizer`` (``HF_HUB_OFFLINE=1``: nothing is downloaded), then prints
one JSON line: the load time, the ids the exported tokenizer gives ``--prompt``, and the greedy
tokens generated after ``--prompt-ids`` in each mode (``fused:N``: N fused prefill passes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fbt_megatron.launch.rehearsal.hf_check", description=__doc__.splitlines()[0])
    p.add_argument("--export", required=True, help="the Hugging Face export folder")
    p.add_argument("--prompt", required=True, help="text the exported tokenizer encodes (its ids are reported)")
    p.add_argument("--prompt-ids", required=True, help="the prompt as space-separated ids")
    p.add_argument("--mode", action="append", default=[], help="standard, soft or fused:N (repeat)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    return p.parse_args(argv)


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = parse(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.export, trust_remote_code=True, dtype=torch.float32).eval()
    loaded = time.perf_counter() - start
    tokenizer = AutoTokenizer.from_pretrained(args.export, trust_remote_code=True)
    ids = torch.tensor([[int(x) for x in args.prompt_ids.split()]])
    tokens = {}
    with torch.no_grad():
        for mode in args.mode or ["standard"]:
            name, _, n = mode.partition(":")
            out = model.generate(ids, decode_mode=name, fused_prefill_passes=int(n or 0), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            tokens[mode] = out[0, ids.shape[1]:].tolist()
    print(json.dumps({"load_seconds": loaded, "parameters": sum(p.numel() for p in model.parameters()),
                      "tokenizer_ids": tokenizer(args.prompt, add_special_tokens=False).input_ids, "tokens": tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
