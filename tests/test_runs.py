"""A run folder alone rebuilds its model (``fbt_megatron.inference.runs``): the recipe and vocabulary size
recorded with every checkpoint, the model's outputs, and one line for what cannot be loaded."""

import json

import pytest
import torch
from test_train import SMALL, train

from fbt_megatron.inference.runs import load_run, run_recipe
from fbt_megatron.recipe import RecipeError


def test_a_run_folder_rebuilds_the_model_it_trained(tmp_path, small_corpus):
    run = tmp_path / "run"
    train(tmp_path / "train.log", *SMALL, "--train-iters", "4", "--save", str(run), "--num-layers", "2",
          corpus=small_corpus)
    recipe, state = run_recipe(str(run))
    assert recipe.training.train_iters == 4 and recipe.model_overrides["num_layers"] == 2  # the flags, not the file's
    assert state["vocab_size"] == 512 and state["iteration"] == 4

    loaded = load_run(str(run))
    assert loaded.model.config.num_layers == 2 and not loaded.model.training
    assert loaded.tokenizer_path.endswith(".model") and loaded.tokenizer.tokenize("import os")
    # the weights are the trained ones: the validation loss the run logged at its end is reproduced
    from fbt_megatron.trainer.data import build_data

    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    sample = build_data(recipe, 0).valid
    batch = [sample[i] for i in range(recipe.training.global_batch_size)]
    tokens, labels, mask = (torch.stack([torch.as_tensor(b[k]) for b in batch]) for k in ("tokens", "labels", "loss_mask"))
    with torch.no_grad():
        loss, _ = loaded.model(tokens, labels=labels)
    assert (loss * mask).sum().item() / mask.sum().item() == pytest.approx(logged["valid_loss_fused0"], rel=1e-5)


def test_what_cannot_be_loaded_is_one_line(tmp_path):
    with pytest.raises(RecipeError, match="no such run folder"):
        run_recipe(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match="holds no checkpoint"):
        run_recipe(str(tmp_path / "empty"))
