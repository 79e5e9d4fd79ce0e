"""``python -m fbt_megatron.slurm prepare``: a corpus tokenized over many nodes, as two jobs from
slurm/prepare.sbatch: a job array of ``tools/preprocess_data.py --shard I/N`` (one task per
shard, each on a node's CPUs; a requeued task skips its shard once complete), then, after all of
them (``--dependency=afterok``), ``tools/merge_corpus.py`` into the one prefix. Checked before
anything queues: the inputs, the tokenizer and whether the inputs' files make N shards."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import List, Tuple

from fbt_megatron.launch.slurm.script import REPOSITORY, Resources, quoted, render
from fbt_megatron.recipe import RecipeError

TOOLS = REPOSITORY / "tools"


def check(inputs: List[str], tokenizer: str, output_prefix: str, shards: int) -> None:
    """Refuse what would fail once queued: missing inputs, a bad tokenizer, shards without a file."""
    from fbt_megatron.data.documents import sources
    from fbt_megatron.data.shards import assign
    from fbt_megatron.data.tokenizer import load_tokenizer

    if shards < 1:
        raise RecipeError(f"--shards {shards}: give 1 or more")
    try:
        load_tokenizer(tokenizer)
        assign(sources(inputs), shards)
    except (ValueError, FileNotFoundError) as e:
        raise RecipeError(str(e)) from None
    if not Path(output_prefix).resolve().parent.is_dir():
        raise RecipeError(f"--output-prefix {output_prefix}: its folder {Path(output_prefix).resolve().parent} does not exist")


def jobs(name: str, inputs: List[str], tokenizer: str, output_prefix: str, shards: int, tool_args: List[str],
         res: Resources, workdir: Path, python: str) -> List[Tuple[str, str]]:
    """The shard array and the merge after it: (name, script) each."""
    prefix = str(Path(output_prefix).resolve())
    shard = ["--input", *(str(Path(i).resolve()) for i in inputs), "--tokenizer", str(Path(tokenizer).resolve()),
             "--output-prefix", prefix]
    common = dict(time=res.time, log_dir=shlex.quote(str(res.log_dir)), workdir=shlex.quote(str(workdir)),
                  repository=shlex.quote(str(REPOSITORY)), container=res.container(workdir), environment=res.exports(),
                  python=res.python(python),
                  sbatch_options=res.options(gpus=0, cpus_per_task=res.cpus_per_task, exclusive=res.cpus_per_task is None))
    array = render("prepare.sbatch", name=name, log_name=f"{name}-%A_%a", array_option=f"#SBATCH --array=0-{shards - 1}",
                   what=f"shard $SLURM_ARRAY_TASK_ID of {shards}",
                   command=f"{shlex.quote(str(TOOLS / 'preprocess_data.py'))} {quoted(shard)} "
                           f'--shard "$SLURM_ARRAY_TASK_ID/{shards}" --workers "$CPUS" {quoted(tool_args)}'.rstrip(),
                   **common)
    merge = render("prepare.sbatch", name=f"{name}-merge", log_name=f"{name}-merge-%j", array_option="",
                   what=f"merges {shards} shards into {prefix}",
                   command=f"{shlex.quote(str(TOOLS / 'merge_corpus.py'))} "
                           f"{quoted(['--output-prefix', prefix, '--shards', shards])}", **common)
    return [(name, array), (f"{name}-merge", merge)]
