"""A recipe's model at its real width through every stage of a run, on this machine, measured.

    python tools/rehearse.py --recipe recipes/fbt_1b_100b.yaml --output runs/rehearsal
    python tools/rehearse.py --recipe recipes/fbt_1b_100b.yaml --output runs/rehearsal-1l --num-layers 1 --seq-length 64
    python tools/rehearse.py --recipe recipes/fbt_1b_100b.yaml --output runs/preflight --nproc-per-node 8 \\
        -- --tensor-model-parallel-size 2 --sequence-parallel true --bf16 true

Training k = 1 then k = 3 with pass recompute and the recipe's optimizer, a torch_dist checkpoint
(async where the memory budget holds it) resumed bit for bit and resharded to TP 2, the bfloat16 Hugging Face export loaded
offline by transformers with greedy tokens equal to megatron's generate in standard, soft and
fused(2), from-hf back bit-exact, vLLM when .venv-serve exists; peak memory against the planner.
Flags after ``--`` go to every training stage (a job's layout on a GPU node). Prints one table and
writes DIR/rehearsal.json; exit code 0 when every check ran and passed, 1 when one failed, 3 when none
failed but a check or a stage asked for was skipped (vLLM without .venv-serve; --no-vllm does not ask for
it); the report is the one tools/gpu_check.py writes (fbt_megatron/launch/rehearsal/report.py).
Every stage runs with TF32 off and Transformer Engine's attention deterministic (measure.EXACT_ENV).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fbt_megatron.common.cli import quiet_library_warnings, run_cli  # noqa: E402
from fbt_megatron.common.logs import setup_logging  # noqa: E402


def main(argv=None) -> int:
    setup_logging()
    quiet_library_warnings()
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, train_flags = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="python tools/rehearse.py", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="the recipe whose model is rehearsed")
    parser.add_argument("--output", required=True, type=Path, help="a new folder for every artefact and rehearsal.json")
    parser.add_argument("--num-layers", type=int,
                        help="fewer layers at the same width (default: the recipe's, or the most that fit --memory-budget-gib)")
    parser.add_argument("--memory-budget-gib", type=float,
                        help="what a training stage's processes may hold together on CPU, by the planner's estimate x 1.1 "
                             "(default: 90%% of the memory available at the start; docs/planning.md)")
    parser.add_argument("--seq-length", type=int, default=256, help="training sequence (default 256)")
    parser.add_argument("--vocab-size", type=int,
                        help="the embedding's rows: the corpus tokenizer widened to this size (default: the preset's)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes of the training and resume stages (default 1)")
    parser.add_argument("--reshard-tp", type=int, default=2, help="tensor-parallel size of the reshard stage (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="greedy tokens per decode mode (default 8)")
    parser.add_argument("--max-shard-size", default="1GB", help="of the export's safetensors (default 1GB)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (default: torch's)")
    parser.add_argument("--no-vllm", action="store_true",
                        help="leave the vLLM stage out (default: run it; without .venv-serve it is skipped and the report not ok)")
    parser.add_argument("--echo", action="store_true", help="show the stages' output as it comes")
    args = parser.parse_args(own)

    from fbt_megatron.common.folders import check_new_folder
    from fbt_megatron.launch.rehearsal.stages import Options, rehearse

    check_new_folder(args.output, "--output")
    from fbt_megatron.recipe import flags

    flags.parse(["--recipe", args.recipe, *train_flags], prog="python tools/rehearse.py", description="")  # bad: one line
    options = Options(recipe=args.recipe, output=args.output, num_layers=args.num_layers, seq_length=args.seq_length,
                      memory_budget_gib=args.memory_budget_gib,
                      vocab_size=args.vocab_size, nproc_per_node=args.nproc_per_node, reshard_tp=args.reshard_tp,
                      max_new_tokens=args.max_new_tokens, max_shard_size=args.max_shard_size, train_flags=train_flags,
                      threads=args.threads, vllm=not args.no_vllm, echo=args.echo)
    return rehearse(options).exit_code()


if __name__ == "__main__":
    run_cli(main)
