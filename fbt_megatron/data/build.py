"""The data of a training run: its tokenizer and its training and validation datasets.

One of four sources: GPTDatasets of a prepared corpus or of a Megatron blend of ``.bin/.idx``
files, the examples of a state-tracking task (``fbt_megatron.data.state_tracking``), or packed
chat conversations (``--sft``: ``fbt_megatron.data.sft``). The embedded default corpus, the tasks
and the tiny SFT set are prepared on first use (rank 0 prepares, the others wait).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from fbt_megatron.data import sft
from fbt_megatron.data.corpus import ensure_corpus, load_corpus
from fbt_megatron.data.datasets import build_datasets, token_id_problem
from fbt_megatron.data.tokenizer import load_tokenizer
from fbt_megatron.errors import RecipeError
from fbt_megatron.recipe import Recipe
from fbt_megatron.data import state_tracking


@dataclass
class Data:
    tokenizer: object
    train: object
    valid: object
    source: str


def build_data(recipe: Recipe, world_rank: int) -> Data:
    """Tokenizer and datasets: GPTDatasets of a corpus or a blend, the examples of a
    state-tracking task (``fbt_megatron.data.state_tracking``), or packed chat conversations
    (``--sft``: ``fbt_megatron.data.sft``). The embedded default corpus, the tasks and the tiny SFT
    set are prepared on first use (rank 0 prepares, the others wait)."""
    d, t = recipe.data, recipe.training
    if d.sft:
        if recipe.parallel.context_parallel_size > 1:
            raise RecipeError("--sft packs conversations into rows, which context parallelism would split: use "
                              "--context-parallel-size 1")
        if d.train_data_path is None and sft.set_source(d.corpus):
            if world_rank == 0:
                sft.ensure_sft_set(d.corpus, d.data_path, d.tokenizer_model, d.seq_length)
            dist.barrier()
        tokenizer, train, valid, source = sft.load_sft_data(d, t.seed, report=world_rank == 0)
        return Data(tokenizer=tokenizer, train=train, valid=valid, source=source)
    gbs = t.global_batch_size
    num_samples = (t.train_iters * gbs, max(1, t.eval_iters) * gbs)
    task = state_tracking.task_name(d.corpus)
    if d.train_data_path is None and (task or (d.corpus is None and state_tracking.is_task_folder(d.data_path))):
        if task:
            if world_rank == 0:
                state_tracking.prepare_task(task, d.data_path, d.seq_length)
            dist.barrier()
        prepared = state_tracking.load_task(d.data_path)
        train, valid = (prepared.dataset(s, d.seq_length, n, t.seed) for s, n in zip(state_tracking.SPLITS, num_samples))
        return Data(tokenizer=prepared.vocabulary, train=train, valid=valid,
                    source=f"{d.data_path} ({prepared.group.name} state tracking)")
    if d.train_data_path is None:
        if d.corpus is not None:
            if world_rank == 0:
                ensure_corpus(d.corpus, d.data_path, vocab_size=d.vocab_size)
            dist.barrier()
        elif not (Path(d.data_path) / "corpus.json").is_file():
            raise RecipeError(f"data.data_path {d.data_path} is not a prepared corpus (no corpus.json)")
        corpus = load_corpus(d.data_path)
        tokenizer_path = d.tokenizer_model or corpus.tokenizer_path
        train_blend, valid_blend = ([corpus.train_prefix], None), ([corpus.valid_prefix], None)
        source, cache = str(d.data_path), d.data_cache_path or str(Path(d.data_path) / "cache")
    else:
        tokenizer_path = d.tokenizer_model
        train_blend = _blend(d.train_data_path, "data.train_data_path")
        valid_blend = _blend(d.valid_data_path, "data.valid_data_path") if d.valid_data_path else None
        source = " ".join(map(str, d.train_data_path))
        cache = d.data_cache_path or str(Path(recipe.checkpoint.save or ".") / "data_cache")
    tokenizer = load_tokenizer(tokenizer_path)
    if d.train_data_path is not None:  # a blend made with another tokenizer: one line, not an IndexError at step 1
        for key, (prefixes, _) in (("data.train_data_path", train_blend), ("data.valid_data_path", valid_blend or ([], None))):
            for prefix in prefixes:
                problem = token_id_problem(prefix, tokenizer.vocab_size, tokenizer_path, key)
                if problem:
                    raise RecipeError(problem)
    train, valid, _ = build_datasets(
        tokenizer,
        seq_length=d.seq_length,
        seed=t.seed,
        num_samples=(*num_samples, None),
        cache_dir=cache,
        blend_per_split=[train_blend, valid_blend or train_blend, None],
    )
    return Data(tokenizer=tokenizer, train=train, valid=valid, source=source)


def _blend(spec: list, key: str):
    """Megatron's blend list ([w, prefix, w, prefix, ...] or [prefix, ...]) → (prefixes, weights)."""
    if all(isinstance(x, str) for x in spec):
        prefixes, weights = list(spec), None
    elif len(spec) % 2 == 0 and all(isinstance(w, (int, float)) for w in spec[0::2]):
        prefixes, weights = [str(p) for p in spec[1::2]], [float(w) for w in spec[0::2]]
    else:
        raise RecipeError(f"{key} must be [prefix, ...] or [weight, prefix, weight, prefix, ...]")
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).is_file():
                raise RecipeError(f"{key}: data file not found: {prefix + ext}")
    return prefixes, weights
