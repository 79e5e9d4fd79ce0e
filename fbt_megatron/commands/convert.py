"""``python -m fbt_megatron.convert to-hf|from-hf ...``: checkpoints to and from Hugging Face format.

    python -m fbt_megatron.convert to-hf --load RUN --output DIR [--ckpt-step N] [--tokenizer-model F]
        [--max-shard-size 2GB] [--dtype bfloat16]
    python -m fbt_megatron.convert from-hf --input DIR --save RUN
        [--tensor-model-parallel-size N --pipeline-model-parallel-size M] [--seed S] [--seq-length T]

Bad input (a missing or damaged checkpoint, an output folder that is not empty, a folder that is
not a Hugging Face model, a checkpoint that cannot map) is one ``error:`` line and exit code 2,
with nothing written.
"""

from __future__ import annotations

import argparse
import sys

from fbt_megatron.common.cli import quiet_library_warnings, run_cli
from fbt_megatron.common.logs import setup_logging


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one ``error:`` line (through ``run_cli``), not usage + error."""

    def error(self, message):
        raise ValueError(f"{message} (see {self.prog} --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m fbt_megatron.convert",
                description="Convert fbt-megatron checkpoints to and from Hugging Face format.")
    sub = p.add_subparsers(dest="command", metavar="{to-hf,from-hf}", parser_class=_Parser)
    sub.required = True

    to = sub.add_parser("to-hf", help="a run folder → a Hugging Face model folder (remote code, safetensors)",
                        description="Export a run folder's checkpoint (any TP/PP layout) to a new Hugging Face model "
                                    "folder loadable with AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True).")
    to.add_argument("--load", required=True, metavar="RUN", help="the run folder (its latest checkpoint unless --ckpt-step)")
    to.add_argument("--output", required=True, metavar="DIR", help="the export folder to create (missing or empty)")
    to.add_argument("--ckpt-step", type=int, metavar="N", help="export iteration N's checkpoint instead of the latest")
    to.add_argument("--tokenizer-model", metavar="FILE", help="the tokenizer file, when the run's corpus is not where it was trained")
    to.add_argument("--max-shard-size", default="2GB", metavar="SIZE",
                    help="split the safetensors into shards of at most this size (default 2GB; 500MB, 1GiB, ...)")
    to.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the weights' type in the safetensors (default float32, as trained on CPU; bfloat16 halves the files)")

    frm = sub.add_parser("from-hf", help="a Hugging Face folder (an FBT export or a Llama-style model) → a run folder",
                         description="Import an FBT export, or a Llama-style checkpoint (llama, mistral, qwen3; tied "
                                     "embeddings, no biases) as an FBT model with fresh fusion weights, into a new run "
                                     "folder holding a weights-only checkpoint at iteration 0.")
    frm.add_argument("--input", required=True, metavar="DIR", help="the Hugging Face model folder (config.json + safetensors)")
    frm.add_argument("--save", required=True, metavar="RUN", help="the run folder to create (missing or empty)")
    frm.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="N",
                     help="check that the model splits into N tensor-parallel ranks (the checkpoint is resharded on load)")
    frm.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="M",
                     help="check that the model splits into M pipeline stages (the checkpoint is resharded on load)")
    frm.add_argument("--seed", type=int, default=1234, help="seed of the fresh fusion weights of a Llama-style import (default 1234)")
    frm.add_argument("--seq-length", type=int, metavar="T",
                     help="the recipe's training sequence length (default: an export's; a Llama model's context, at most 8192)")
    return p


def main(argv=None) -> int:
    setup_logging()
    quiet_library_warnings()
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "to-hf":
        from fbt_megatron.inference.convert.to_hf import export

        export(args.load, args.output, ckpt_step=args.ckpt_step, tokenizer_model=args.tokenizer_model,
               max_shard_size=args.max_shard_size, dtype=args.dtype)
    else:
        from fbt_megatron.inference.convert.from_hf import import_checkpoint

        if args.seq_length is not None and args.seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {args.seq_length}")
        import_checkpoint(args.input, args.save, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                          seed=args.seed, seq_length=args.seq_length)
    return 0


def cli() -> None:
    """A console-script entry point (e.g. ``fbt-convert``)."""
    run_cli(main)


if __name__ == "__main__":
    cli()
