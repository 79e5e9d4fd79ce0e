"""A Hugging Face model folder → a megatron run folder (``python -m fbt_megatron.convert from-hf``).

Two kinds of input:

* an FBT export (config.json ``model_type: fbt``, written by ``to-hf``): every weight maps back
  exactly, so export → import → export is bit-exact;
* a Llama-style checkpoint (``model_type`` llama or mistral, also qwen3 (its q/k norms are FBT's
  qk_norm)): the plain transformer becomes an FBT model without sandwich norms, headwise gate or
  qk norm (qwen3: with it), residual scale α = 1, RoPE θ and sliding window from its config, tied
  embeddings, and fresh fusion weights (W_U, W_G ~ N(0, 0.02²) as in training, fusion norm ones):
  in standard decoding (no fusion) it computes what the HF model computes, and FBT training can
  start from it. What cannot map is refused with one line: untied embeddings, biases, RoPE
  scaling, mixture of experts, an activation other than SiLU, another model type.

The run folder gets a weights-only checkpoint at iteration 0 (``checkpointing.save`` with no
optimizer, as ``--create-seed-checkpoint`` writes) whose training state records the recipe (the
model's shape as overrides of a preset, all architecture fields explicit) and the embedding's
size, the tokenizer file copied into the folder (``tokenizer.model`` / ``tokenizer.json``, named by
the recipe's ``data.tokenizer_model``), ``recipe.yaml`` (the same recipe, to train from:
``--recipe RUN/recipe.yaml --load RUN``) and ``import.json`` (where it came from). The checkpoint
is written by one process, unsharded; dist_checkpointing reshards it for any TP/PP layout that
loads it. The folder is written whole (``io.atomic_folder``); RUN may be missing (its parents
are created) or an empty folder; anything else there is refused.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from fbt_megatron.common.folders import check_new_folder
from fbt_megatron.common.io import atomic_folder
from fbt_megatron.inference.convert import mapping
from fbt_megatron.inference.convert.mapping import ConversionError
from fbt_megatron.inference.convert.to_hf import read_safetensors

LLAMA_LIKE = ("llama", "mistral", "qwen3")
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")


def read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise ConversionError(f"--input {folder}: no such folder")
    file = folder / "config.json"
    if not file.is_file():
        raise ConversionError(f"--input {folder} is not a Hugging Face model folder (no config.json)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConversionError(f"{file} has no model_type: not a Hugging Face model config")
    return config


# ---------------------------------------------------------------- Llama-style checkpoints
def _refuse(what: str, model_type: str):
    raise ConversionError(f"cannot import this {model_type} checkpoint: {what}")


def llama_as_fbt(folder: Path, raw: dict) -> dict:
    """A Llama-style config as an FBT export's config.json (``mapping.complete_fbt_config`` keys)."""
    from transformers import AutoConfig

    model_type = raw["model_type"]
    try:
        cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises many kinds
        raise ConversionError(f"{folder}/config.json: transformers cannot read it: {str(e).splitlines()[0]}") from None
    get = lambda name, default=None: getattr(cfg, name, default)
    if not get("tie_word_embeddings", False):
        _refuse("its embeddings are untied (tie_word_embeddings false); FBT ties the output layer to the embedding", model_type)
    if get("attention_bias", False) or get("mlp_bias", False):
        _refuse("it has attention or MLP biases (FBT layers have none)", model_type)
    if get("hidden_act", "silu") != "silu":
        _refuse(f"its activation is {get('hidden_act')!r} (FBT's MLP is SwiGLU: silu)", model_type)
    for moe in ("num_local_experts", "num_experts", "n_routed_experts"):
        if get(moe):
            _refuse(f"it is a mixture of experts ({moe} {get(moe)})", model_type)
    rope = get("rope_parameters") or {}
    if rope and not isinstance(rope.get("rope_type", "default"), str):  # per-layer-type parameters
        _refuse(f"its RoPE parameters differ per layer type ({sorted(rope)})", model_type)
    rope_type = rope.get("rope_type", "default")
    scaling = get("rope_scaling")
    if rope_type != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default"):
        _refuse(f"it uses RoPE scaling ({rope_type if rope_type != 'default' else scaling}); FBT has plain RoPE", model_type)
    theta = rope.get("rope_theta", get("rope_theta", 10000.0))
    if get("partial_rotary_factor", 1.0) not in (None, 1.0):
        _refuse(f"it rotates part of each head (partial_rotary_factor {get('partial_rotary_factor')})", model_type)
    heads, groups = cfg.num_attention_heads, get("num_key_value_heads") or cfg.num_attention_heads
    if heads % groups:
        _refuse(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}", model_type)
    head_dim = get("head_dim") or cfg.hidden_size // heads
    window = None
    if model_type == "mistral":
        window = get("sliding_window")
    elif model_type == "qwen3" and get("use_sliding_window", False):
        _refuse("it uses sliding windows on some layers only (use_sliding_window with max_window_layers)", model_type)
    types = get("layer_types")
    if types and any(t != ("sliding_attention" if window else "full_attention") for t in types):
        _refuse(f"its layer_types {sorted(set(types))} do not fit a single attention kind", model_type)
    return mapping.complete_fbt_config({
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float(theta),
        "max_position_embeddings": get("max_position_embeddings", 8192),
        "sliding_window": window,
        "full_attention_every": None,
        "residual_scale": 1.0,
        "sandwich_norm": False,
        "attention_gate": False,
        "qk_norm": model_type == "qwen3",
        "latent_feedback": True,
        "feedback_source": "residual",
        "bos_token_id": get("bos_token_id"),
        "eos_token_id": get("eos_token_id"),
        "pad_token_id": get("pad_token_id"),
    })


def llama_tensors(tensors: Dict[str, torch.Tensor], model_type: str) -> Dict[str, torch.Tensor]:
    """A Llama-style state dict in the FBT export's names (Llama's ``post_attention_layernorm``
    is the MLP's input norm: FBT's ``pre_feedforward_layernorm``)."""
    biases = [n for n in tensors if n.endswith(".bias")]
    if biases:
        _refuse(f"it has biases ({biases[0]}{f' and {len(biases) - 1} more' if len(biases) > 1 else ''})", model_type)
    out = {}
    for name, t in tensors.items():
        if "rotary_emb." in name:
            continue  # a stored RoPE buffer (older checkpoints): recomputed from θ
        if name == "lm_head.weight":
            embed = tensors.get("model.embed_tokens.weight")
            if embed is None or not torch.equal(embed, t):
                _refuse("it stores an lm_head different from the embedding (untied output layer)", model_type)
            continue
        out[name.replace(".post_attention_layernorm.", ".pre_feedforward_layernorm.")] = t
    return out


# ---------------------------------------------------------------- the recipe of an imported model
def preset_and_overrides(fields: dict) -> tuple:
    """(preset, overrides): the preset closest to the model's shape, every architecture field explicit."""
    from fbt_megatron.model.config import PRESETS

    def distance(name):
        return sum(PRESETS[name].get(k) != v for k, v in fields.items())

    return min(sorted(PRESETS), key=distance), dict(fields)


def import_recipe(h: dict, tokenizer_file: Optional[str], seed: int, seq_length: int) -> dict:
    """The recipe (``Recipe.to_dict()`` form) of an imported model."""
    from fbt_megatron.recipe import recipe_from_dict

    preset, overrides = preset_and_overrides(mapping.fbt_fields(h))
    raw = {
        "model": {"preset": preset, **overrides},
        "data": {"data_path": None, "corpus": None, "tokenizer_model": tokenizer_file, "seq_length": seq_length},
        "training": {"seed": seed},
    }
    return recipe_from_dict(raw).to_dict()  # type-checked, every field present


def check_layout(h: dict, tp: int, pp: int) -> None:
    """Refuse a layout the model cannot be split into (the checkpoint itself is layout-free)."""
    if tp < 1 or pp < 1:
        raise ConversionError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    for key in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
        if h[key] % tp:
            raise ConversionError(f"{key} {h[key]} is not divisible by --tensor-model-parallel-size {tp}")
    if h["num_hidden_layers"] % pp:
        raise ConversionError(f"num_hidden_layers {h['num_hidden_layers']} is not divisible by --pipeline-model-parallel-size {pp}")


# ---------------------------------------------------------------- the import
def _as_fbt_config(folder: Path, raw: dict) -> dict:
    """The FBT config (HF keys) of an FBT export or a Llama-style checkpoint; one line for the rest."""
    model_type = raw["model_type"]
    if model_type == "fbt":
        return mapping.complete_fbt_config(raw)
    if model_type in LLAMA_LIKE:
        return llama_as_fbt(folder, raw)
    if model_type == "qwen2":
        _refuse("its attention has q/k/v biases (FBT layers have none)", model_type)
    raise ConversionError(f"cannot import model_type {model_type!r}: fbt-megatron reads FBT exports and "
                          f"Llama-style checkpoints ({', '.join(LLAMA_LIKE)})")


def _mapped_weights(folder: Path, shape, model_type: str) -> dict:
    """The checkpoint's tensors under megatron-core's names; one line for a tensor with no place."""
    fbt = model_type == "fbt"
    tensors = read_safetensors(folder)
    if not fbt:
        tensors = llama_tensors(tensors, model_type)
    weights = mapping.from_hf(tensors, shape, fusion=fbt and shape.latent_feedback)
    expected = set(mapping.hf_shapes(shape)) if fbt else {n for n in mapping.hf_shapes(shape) if not n.startswith("model.feedback.")}
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise ConversionError(f"{folder}: weight {unexpected[0]}{more} has no place in the FBT model (cannot map it)")
    return weights


def import_checkpoint(input: str, save: str, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                      seed: int = 1234, seq_length: Optional[int] = None, say: Callable[[str], None] = print) -> Path:
    """Convert HF folder ``input`` to the new run folder ``save``; returns it. Raises ValueError
    (one line) for what cannot be imported, before anything is written."""
    from fbt_megatron.common import platform
    from fbt_megatron.inference.runs import build_inference_model
    from fbt_megatron.model.config import recipe_config
    from fbt_megatron.recipe import recipe_from_dict
    from fbt_megatron.trainer import checkpointing
    from fbt_megatron.trainer.checkpointing import TrainState

    folder = Path(input)
    raw = read_config(folder)
    out = check_new_folder(save, "--save")
    model_type = raw["model_type"]
    fbt = model_type == "fbt"
    h = _as_fbt_config(folder, raw)
    check_layout(h, tensor_model_parallel_size, pipeline_model_parallel_size)
    shape = mapping.Shape.of_hf(h)
    weights = _mapped_weights(folder, shape, model_type)

    tokenizer = next((folder / n for n in TOKENIZER_FILES if (folder / n).is_file()), None)
    final_tokenizer = str(out.absolute() / tokenizer.name) if tokenizer else None
    # the training sequence length: an export's own; a Llama-style model's context, at most 8192
    length = seq_length or (int(h["max_position_embeddings"]) if fbt else min(int(h["max_position_embeddings"]), 8192))
    recipe = recipe_from_dict(import_recipe(h, final_tokenizer, seed, length))

    platform.init_distributed(1, 1, seed)  # seeds: a Llama import's fresh fusion weights are drawn from it
    config = recipe_config(recipe, shape.vocab_size)
    model = build_inference_model(config)
    params = dict(model.named_parameters())
    if not fbt and params.keys() - weights.keys() - {n for n in params if n.startswith("feedback_fusion.")}:
        missing = sorted(params.keys() - weights.keys())
        raise ConversionError(f"the FBT model has weights the checkpoint does not fill: {missing[0]}")
    if fbt and params.keys() != weights.keys():
        diff = sorted(params.keys() ^ weights.keys())
        raise ConversionError(f"the export's weights do not fill the FBT model exactly: {diff[0]}")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)

    state = TrainState(model=recipe.to_dict()["model"], recipe=recipe.to_dict(), vocab_size=shape.vocab_size)
    state.lr_schedule = None  # no optimizer yet: a run that loads it follows its own schedule
    with atomic_folder(out) as tmp:
        checkpointing.save(tmp, 0, model, None, None, dataclasses.asdict(state))
        if tokenizer:
            shutil.copyfile(tokenizer, tmp / tokenizer.name)
        write_recipe_yaml(tmp / "recipe.yaml", recipe.to_dict(), folder, out)
        provenance = {
            "source": str(folder.resolve()),
            "model_type": model_type,
            "fresh_fusion_weights": not fbt and shape.latent_feedback,
            "seed": seed,
            "tokenizer": tokenizer.name if tokenizer else None,
            "hf_token_ids": {k: h.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
            "checkpoint_layout": "one process (TP 1, PP 1): dist_checkpointing reshards it for any layout that loads it",
        }
        (tmp / "import.json").write_text(json.dumps(provenance, indent=2) + "\n")
    kind = "FBT export" if fbt else f"{model_type} checkpoint (fresh fusion weights, seed {seed})"
    say(f"imported {folder} ({kind}, {sum(p.numel() for p in params.values()):,} parameters) into {out}/iter_0000000")
    if not tokenizer:
        say(f"note: {folder} has no tokenizer file ({' / '.join(TOKENIZER_FILES)}): give one with --tokenizer-model when loading the run")
    if tensor_model_parallel_size > 1 or pipeline_model_parallel_size > 1:
        say(f"note: the checkpoint is written unsharded; training with --tensor-model-parallel-size {tensor_model_parallel_size} "
            f"--pipeline-model-parallel-size {pipeline_model_parallel_size} --load {out} reshards it on load")
    return out


def write_recipe_yaml(path: Path, recipe: dict, source: Path, run: Path) -> None:
    import yaml

    header = (f"# The recipe of a model imported from {source.resolve()} (python -m fbt_megatron.convert from-hf).\n"
              f"# Train from it (the model section must stay as it is; give the data and the schedule):\n"
              f"#   python -m fbt_megatron.train --recipe {run}/recipe.yaml --load {run} --save NEW_RUN \\\n"
              f"#       --data-path CORPUS --train-iters N ...\n")
    ordered = {"model": recipe["model"], **{k: v for k, v in recipe.items() if k != "model"}}
    path.write_text(header + yaml.safe_dump(ordered, sort_keys=False))
