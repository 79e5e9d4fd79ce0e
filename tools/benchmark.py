"""Benchmarks on this machine, printed as ratios with their goals (their modules: tools/benchmarks/).

    python tools/benchmark.py                       # the k-pass training step, about 1.5 minutes on 2 idle cores
    python tools/benchmark.py --decode              # generation (fbt-1b shape, fp32), a few minutes
    python tools/benchmark.py --optimizers          # the optimizer step, NorMuon + Adam against Adam
    python tools/benchmark.py --serving [--export EXPORT]   # vLLM serving, against vLLM's Qwen3 of the same
                                                    # shape (needs requirements-serve.txt), ~8 minutes
    python tools/benchmark.py --data [--megatron-lm DIR]   # corpus preparation against the raw tokenizers
                                                    # (and Megatron-LM's preprocess_data), a few minutes
    python tools/benchmark.py --quick --json bench.json

Times are medians over interleaved repeats; it prints the ratios with their goals (PASS/MISS) and
always exits 0 (it is a report). Bad flags: one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import BENCHMARKS
from benchmarks.measure import SHAPE_FLAGS

from fbt_megatron.common.cli import quiet_library_warnings, run_cli
from fbt_megatron.common.logs import setup_logging


class _Parser(argparse.ArgumentParser):
    """Bad flags raise ValueError, which ``run_cli`` turns into one ``error:`` line and exit code 2."""

    def error(self, message):
        raise ValueError(message)


def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.splitlines()[0])
    choice = parser.add_mutually_exclusive_group()
    for module in BENCHMARKS:
        if module.FLAG:
            choice.add_argument(module.FLAG, dest="benchmark", action="store_const", const=module, help=module.HELP)
    parser.set_defaults(benchmark=next(m for m in BENCHMARKS if m.FLAG is None))
    parser.add_argument("--preset",
                        help="model preset (default: tiny; fbt-1b with --decode); shape flags not given default to "
                             "the benchmark shape for 'tiny' (4 layers, hidden 256, FFN 768, seq 256) and to the "
                             "preset's own shape otherwise")
    parser.add_argument("--prompt-length", type=int, metavar="N",
                        help="--decode / --serving: prompt tokens (default: 16 / 32)")
    parser.add_argument("--new-tokens", type=int, metavar="N",
                        help="--decode / --serving: tokens generated in the decode measurement (default: 9 / 64, >= 2)")
    parser.add_argument("--export", metavar="DIR",
                        help="--serving: an FBT export to serve (default: a random one of the benchmark shape)")
    parser.add_argument("--megatron-lm", metavar="DIR",
                        help="--data: a Megatron-LM checkout whose tools/preprocess_data.py is compared (default: not run)")
    parser.add_argument("--megatron-lm-python", metavar="PYTHON",
                        help="--data: the interpreter that runs Megatron-LM's tool (default: this one)")
    parser.add_argument("--data-megabytes", type=int, metavar="N",
                        help="--data: MB of JSONL timed, and the 1× of the memory ratio (default: 16)")
    for name in SHAPE_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), type=int, metavar="N")
    parser.add_argument("--sliding-window", type=int, metavar="N", help="attention window (0: every layer global)")
    parser.add_argument("--micro-batch-size", type=int, metavar="N", help="sequences per step (default: 4)")
    parser.add_argument("--repeats", type=int, metavar="N", help="timed steps per variant (default: 21)")
    parser.add_argument("--warmup", type=int, metavar="N", help="untimed rounds first (default: 2)")
    parser.add_argument("--threads", type=int, metavar="N", default=2, help="torch intra-op threads (default: 2)")
    parser.add_argument("--seed", type=int, metavar="N", default=1234, help="weights and tokens (default: 1234)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the preset's own (tiny) shape, micro-batch 2, 1 repeat, 1 warmup round")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    defaults = dict(args.benchmark.DEFAULTS)
    if args.quick:
        defaults.update(preset="tiny", micro_batch_size=2, repeats=1, warmup=1)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.new_tokens is not None and args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2, got {args.new_tokens}")
    for name in (*SHAPE_FLAGS, "micro_batch_size", "repeats", "threads", "prompt_length", "data_megabytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("warmup", "sliding_window"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.export is not None and not (Path(args.export) / "config.json").is_file():
        raise ValueError(f"--export {args.export} is not an export folder (no config.json): give a to-hf output")
    if args.megatron_lm is not None and not (Path(args.megatron_lm) / "tools" / "preprocess_data.py").is_file():
        raise ValueError(f"--megatron-lm {args.megatron_lm} has no tools/preprocess_data.py: give a Megatron-LM checkout")
    if args.json is not None and args.json.is_dir():
        raise ValueError(f"--json {args.json} is a directory; give a file path")
    return args


def main(argv=None) -> int:
    setup_logging()
    quiet_library_warnings()
    args = parse_args(argv)
    results = args.benchmark.measure(args)
    print(args.benchmark.format_report(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_cli(main)
