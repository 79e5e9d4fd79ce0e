"""Generate text from a trained run.

    python -m fbt_megatron.generate --load RUN --prompt "def f(" [--prompt ...] [--mode soft]
        [--fused-passes N] [--tolerance 1e-3 --max-passes 8] [--max-new-tokens 32]
        [--temperature 0 --top-p 1 --seed 0] [--ckpt-step N] [--tokenizer-model FILE] [--print-ids]
    python -m fbt_megatron.generate --load SFT_RUN --chat --prompt "What does json.loads do?" [--system TEXT]

Several prompts are generated as one batch. The mode defaults to soft decoding for an FBT run and
standard decoding for a baseline (``decode_modes.default_mode``, as the export, vLLM and lm-eval);
generation stops at the tokenizer's end of document unless
--ignore-eod. With ``--chat`` every ``--prompt`` is a user message (after ``--system``'s, if given),
rendered with the chat template the SFT run trained with (``add_generation_prompt``, tokenized as
training tokenized it) and only the reply is printed. Bad input is one ``error:`` line and exit
code 2.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch

from fbt_megatron.inference.generate.decoding import MODES


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line through cli.run_cli, not usage + message
        raise ValueError(message)


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = _Parser(prog="python -m fbt_megatron.generate", description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--load", required=True, metavar="RUN", help="a trained run folder")
    p.add_argument("--ckpt-step", type=int, metavar="N", help="its checkpoint of iteration N (default: the newest)")
    p.add_argument("--tokenizer-model", metavar="FILE", help="the tokenizer file, if not where the run was trained")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                   help="a prompt as space-separated token ids (also for runs without a text tokenizer)")
    p.add_argument("--chat", action="store_true",
                   help="each --prompt is a user message, in the chat template the SFT run trained with; prints the reply")
    p.add_argument("--system", metavar="TEXT", help="--chat: a system message before each user message")
    p.add_argument("--mode", metavar="MODE",
                   help=f"one of {', '.join(MODES)} (default: fused with --fused-passes, soft with latent feedback, "
                        "else standard)")
    p.add_argument("--fused-passes", type=int, default=0, metavar="N", help="fused prefill passes of --mode fused")
    p.add_argument("--tolerance", type=float, default=1e-3, help="--mode adaptive: stop when RMS(Δs) is below this")
    p.add_argument("--max-passes", type=int, default=8, metavar="N", help="--mode adaptive: at most N prefill passes")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: all tokens)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--max-length", type=int, metavar="N",
                   help="longest prompt + generation (default: the run's seq_length)")
    p.add_argument("--ignore-eod", action="store_true", help="do not stop at the end-of-document token")
    p.add_argument("--no-cache", action="store_true", help="recompute every position (slow; for checks)")
    p.add_argument("--print-ids", action="store_true", help="print each sequence as token ids, not text (for checks)")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads")
    args = p.parse_args(argv)
    if args.mode is not None and args.mode not in MODES:
        raise ValueError(f"--mode {args.mode}: unknown mode; choose one of {', '.join(MODES)}")
    if args.fused_passes and args.mode not in (None, "fused"):
        raise ValueError(f"--fused-passes is for --mode fused, not --mode {args.mode}")
    if args.fused_passes and args.mode is None:
        args.mode = "fused"
    if not args.prompt and not args.prompt_ids:
        raise ValueError("give at least one --prompt TEXT or --prompt-ids IDS")
    if args.chat and args.prompt_ids:
        raise ValueError("--chat takes user messages as --prompt TEXT, not --prompt-ids")
    if args.system is not None and not args.chat:
        raise ValueError("--system is a chat's system message: add --chat")
    return args


def _ids(text: str) -> List[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected space-separated integers") from None


def chat_prompts(run, messages: List[str], system: Optional[str]) -> List[List[int]]:
    """Token ids of one-turn chats (each user message, after the system message if any) ending in
    the assistant's header, as the SFT run's training rendered and tokenized its prompts."""
    from fbt_megatron.data.sft import sft_chat_template
    from fbt_megatron.data.sft.chat import ChatEncoder

    if not getattr(run.recipe.data, "sft", False):
        raise ValueError(f"--chat needs an SFT run (its chat template); {run.folder} was not trained with --sft")
    encoder = ChatEncoder(run.tokenizer, *sft_chat_template(run.recipe.data))
    head = [{"role": "system", "content": system}] if system is not None else []
    return [encoder.tokens(encoder.render([*head, {"role": "user", "content": m}], add_generation_prompt=True))
            for m in messages]


def main(argv: Optional[List[str]] = None) -> int:
    from fbt_megatron.common.cli import plural, quiet_library_warnings
    from fbt_megatron.common.errors import ArgumentError
    from fbt_megatron.common.logs import setup_logging
    from fbt_megatron.inference.generate.decoding import generate
    from fbt_megatron.inference.runs import describe, load_run
    from fbt_megatron.model.decode_modes import default_mode

    setup_logging()
    quiet_library_warnings()
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run = load_run(args.load, iteration=args.ckpt_step, tokenizer_model=args.tokenizer_model)
    tokenizer = run.tokenizer
    mode = args.mode or default_mode(run.model.config.latent_feedback)
    if args.prompt and not hasattr(tokenizer, "tokenize"):
        raise ValueError("this run's vocabulary has no text tokenizer: give prompts with --prompt-ids")
    if args.chat:
        prompts = chat_prompts(run, args.prompt, args.system)
    else:
        prompts = [tokenizer.tokenize(text) for text in args.prompt] + [_ids(text) for text in args.prompt_ids]
    eod = getattr(tokenizer, "eod", None)
    stops = () if args.ignore_eod or eod is None else (eod,)
    try:
        result = generate(run.model, prompts, mode=mode, fused_passes=args.fused_passes,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          stop_tokens=stops, seed=args.seed, tolerance=args.tolerance, max_passes=args.max_passes,
                          use_cache=not args.no_cache, max_length=args.max_length, vocab_size=tokenizer.vocab_size)
    except ArgumentError as e:  # generate's arguments are this command's flags
        raise ValueError(e.flags()) from None
    print(f"# {describe(run)}")
    name = f"fused({args.fused_passes})" if mode == "fused" else mode
    passes = f"{result.prefill_passes} prefill pass{'es' if result.prefill_passes > 1 else ''}"
    if mode == "adaptive":
        passes += f" used (tolerance {args.tolerance:g}, at most {args.max_passes})"
    sampling = "greedy"
    if args.temperature:
        sampling = f"temperature {args.temperature:g}, top-p {args.top_p:g}, seed {args.seed}"
    print(f"# mode {name}: {passes}; {sampling}")
    for i, (prompt, generated) in enumerate(zip(prompts, result.tokens), start=1):
        ended = bool(generated) and generated[-1] in stops
        body = generated[:-1] if ended else generated
        print(f"--- {i} ({plural(len(generated), 'token')}{', end of document' if ended else ''})")
        if hasattr(tokenizer, "detokenize") and not args.print_ids:
            print(tokenizer.detokenize(body if args.chat else prompt + body))
        else:
            print(" ".join(map(str, prompt + body)))
    return 0


if __name__ == "__main__":
    from fbt_megatron.common.cli import run_cli

    run_cli(main)
