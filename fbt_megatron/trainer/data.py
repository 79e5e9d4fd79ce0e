"""The data of a training run: prepared once by its entry point, then loaded by every rank.

``prepare_data(recipe)``: the folders a recipe names that are made on first use (the embedded
default corpus, a state-tracking task, the tiny SFT set), written whole; the training command runs
it on rank 0 before the process groups start, so the loop is handed prepared data.
``build_data(recipe, rank)``: the tokenizer and the training and validation datasets from one of
four sources: GPTDatasets of a prepared corpus or of a Megatron blend of ``.bin/.idx`` files, the
examples of a state-tracking task (``fbt_megatron.data.state_tracking``), or packed chat
conversations (``--sft``: ``fbt_megatron.data.sft``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.data import sft, state_tracking
from fbt_megatron.data.corpus import ensure_corpus, load_corpus
from fbt_megatron.data.datasets import blend, build_datasets, token_id_problem
from fbt_megatron.data.tokenizer import load_tokenizer
from fbt_megatron.recipe import Recipe


@dataclass
class Data:
    tokenizer: object
    train: object
    valid: object
    source: str


def prepare_data(recipe: Recipe) -> None:
    """Prepare what the recipe's data names and is not there yet: the tiny SFT set of
    ``--corpus sft:SOURCE``, the state-tracking task of ``--corpus TASK``, the corpus of
    ``--corpus SOURCE``; a folder made with the same settings is left as it is."""
    d = recipe.data
    if d.train_data_path is not None:
        return
    if d.sft:
        if sft.set_source(d.corpus):
            sft.ensure_sft_set(d.corpus, d.data_path, d.tokenizer_model, d.seq_length)
    elif state_tracking.task_name(d.corpus):
        state_tracking.prepare_task(state_tracking.task_name(d.corpus), d.data_path, d.seq_length)
    elif d.corpus is not None:
        ensure_corpus(d.corpus, d.data_path, vocab_size=d.vocab_size)


def build_data(recipe: Recipe, world_rank: int) -> Data:
    """Tokenizer and datasets of prepared data (``prepare_data``): GPTDatasets of a corpus or a
    blend, the examples of a state-tracking task, or packed chat conversations (``--sft``)."""
    d, t = recipe.data, recipe.training
    if d.sft:
        tokenizer, train, valid, source = sft.load_sft_data(d, t.seed)
        return Data(tokenizer=tokenizer, train=train, valid=valid, source=source)
    gbs = t.global_batch_size
    num_samples = (t.train_iters * gbs, max(1, t.eval_iters) * gbs)
    if d.train_data_path is None and (state_tracking.task_name(d.corpus) or
                                      (d.corpus is None and state_tracking.is_task_folder(d.data_path))):
        prepared = state_tracking.load_task(d.data_path)
        train, valid = (prepared.dataset(s, d.seq_length, n, t.seed) for s, n in zip(state_tracking.SPLITS, num_samples))
        return Data(tokenizer=prepared.vocabulary, train=train, valid=valid,
                    source=f"{d.data_path} ({prepared.group.name} state tracking)")
    if d.train_data_path is None:
        if not (Path(d.data_path) / "corpus.json").is_file():
            raise RecipeError(f"data.data_path {d.data_path} is not a prepared corpus (no corpus.json)")
        corpus = load_corpus(d.data_path)
        tokenizer_path = d.tokenizer_model or corpus.tokenizer_path
        train_blend, valid_blend = ([corpus.train_prefix], None), ([corpus.valid_prefix], None)
        source, cache = str(d.data_path), d.data_cache_path or str(Path(d.data_path) / "cache")
    else:
        tokenizer_path = d.tokenizer_model
        train_blend = blend(d.train_data_path, "data.train_data_path")
        valid_blend = blend(d.valid_data_path, "data.valid_data_path") if d.valid_data_path else None
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
