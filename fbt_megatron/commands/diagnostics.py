"""``python -m fbt_megatron.diagnostics <fixed-point|prefill|probes|generation> --load RUN --output DIR``:
each writes ``<DIR>/<command>.json`` and ``<DIR>/<command>.png`` and prints a short summary.
Bad input (a missing run, a baseline where latent feedback is needed, a language-model run where a
state-tracking one is, a count below 1) is one ``error:`` line and exit code 2."""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch


def _parser() -> argparse.ArgumentParser:
    from fbt_megatron.evaluation import diagnostics

    parser = argparse.ArgumentParser(prog="python -m fbt_megatron.diagnostics", allow_abbrev=False,
                                     description=diagnostics.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, module: str, summary: str, multiple_runs: bool = False) -> argparse.ArgumentParser:
        import importlib

        doc = importlib.import_module(f"fbt_megatron.evaluation.diagnostics.{module}").__doc__
        p = sub.add_parser(name, help=summary, description=doc, allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--load", required=True, nargs="+" if multiple_runs else None, metavar="RUN",
                       help="trained run folder" + ("s (baselines are drawn as lines)" if multiple_runs else ""))
        p.add_argument("--output", required=True, metavar="DIR", help=f"folder for {name}.json and {name}.png")
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
        return p

    def validation_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--eval-iters", type=int, default=None,
                       help="validation batches as training evaluates them (default: the run's --eval-iters)")
        p.add_argument("--sequences", type=int, default=None,
                       help="instead: the first SEQUENCES validation sequences (whole microbatches)")

    p = command("fixed-point", "fixed_point", "‖Δs‖ and validation loss against pass j (Fig. 3)")
    p.add_argument("--max-passes", type=int, default=64, help="passes K (default: 64)")
    validation_flags(p)
    p = command("prefill", "prefill", "validation loss against fused prefill passes (Fig. 4)", multiple_runs=True)
    p.add_argument("--fused-passes", type=int, default=None,
                   help="N: fused passes 0 … N (default: the largest --fused-prefill-passes of the runs)")
    validation_flags(p)
    p = command("probes", "probes", "linear probes per layer, standard vs fused (Sec. 4.4)")
    p.add_argument("--fused-passes", type=int, nargs="*", default=None,
                   help="n of the fused modes probed besides the standard one (default: 1 … the run's --fused-prefill-passes)")
    p.add_argument("--train-sequences", type=int, default=256, help="sequences the probes are fit on (default: 256)")
    p.add_argument("--test-sequences", type=int, default=256, help="sequences the probes are scored on (default: 256)")
    p.add_argument("--length", type=int, default=None, help="sequence length (default: the training length)")
    p = command("generation", "generation", "state-tracking accuracy under KV-cache decoding")
    p.add_argument("--fused-passes", type=int, nargs="*", default=[1, 2, 3], help="n of the fused(n) modes (default: 1 2 3)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4],
                   help="position buckets, as multiples of the training length (default: 1 2 4)")
    p.add_argument("--prompt-length", type=int, default=None, help="prompt tokens (default: half the training length)")
    p.add_argument("--sequences", type=int, default=64, help="test sequences (default: 64)")
    p.add_argument("--no-cache", action="store_true", help="decode without the KV cache (a check)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from fbt_megatron.common.cli import quiet_library_warnings
    from fbt_megatron.common.logs import setup_logging
    from fbt_megatron.evaluation.diagnostics import common

    setup_logging()
    quiet_library_warnings()
    args = _parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(common.positive(args.threads, "--threads"))
    output = common.output_folder(args.output)
    if args.command == "fixed-point":
        from fbt_megatron.evaluation.diagnostics import fixed_point as module

        common.positive(args.max_passes, "--max-passes")
        result = module.fixed_point(common.load(args.load), args.max_passes, args.eval_iters, args.sequences)
    elif args.command == "prefill":
        from fbt_megatron.evaluation.diagnostics import prefill as module

        result = module.prefill([common.load(f) for f in args.load], args.fused_passes, args.eval_iters, args.sequences)
    elif args.command == "probes":
        from fbt_megatron.evaluation.diagnostics import probes as module

        result = module.probes(common.load(args.load), args.fused_passes, args.train_sequences, args.test_sequences, args.length)
    else:
        from fbt_megatron.evaluation.diagnostics import generation as module

        result = module.generation(common.load(args.load), args.fused_passes, args.lengths, args.prompt_length,
                                   args.sequences, use_cache=not args.no_cache)
    common.write_json(output / f"{args.command}.json", result)
    module.plot(result, output / f"{args.command}.png")
    print(module.summary(result))
    print(f"wrote {output / args.command}.json and {output / args.command}.png")
    return 0


if __name__ == "__main__":
    from fbt_megatron.common.cli import run_cli

    run_cli(main)
