"""Training recipes: typed dataclasses loaded from YAML, with Megatron-style command-line overrides.

A recipe has one section per concern. Field names are Megatron-LM's argument names, so every field
is also a command-line flag of the same name (``train_iters`` ↔ ``--train-iters``); model fields
(``FBTConfig``) go under ``model:`` in YAML and are flags too (``--num-layers``, ``--feedback-jitter``).
Anything wrong (an unknown key, a wrong type, a value out of range, parallel sizes that do not fit
the world) raises ``RecipeError`` with one line naming the key, before any work is done.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional

import yaml


from fbt_megatron import platform


class RecipeError(ValueError):
    """A recipe or command line that cannot be run; the message names the offending key."""


@dataclass
class ModelSection:
    preset: str = "tiny"
    """A preset of fbt_megatron.config.PRESETS; every other key here overrides an FBTConfig field."""


@dataclass
class DataSection:
    data_path: Optional[str] = "data/stdlib-sp2048"
    """A prepared corpus folder (with corpus.json), or the embedded default when ``corpus`` names it."""
    corpus: Optional[str] = "stdlib"
    """Source to prepare ``data_path`` from on first use: ``stdlib`` (embedded), a folder or a JSONL
    file; null: ``data_path`` must already be prepared."""
    vocab_size: int = 2048
    """Tokenizer size when the corpus is prepared here."""
    train_data_path: Optional[List[Any]] = None
    """Megatron blend for training: [weight, prefix, weight, prefix, ...] or [prefix, ...]."""
    valid_data_path: Optional[List[Any]] = None
    tokenizer_model: Optional[str] = None
    """Tokenizer file (sentencepiece .model, tokenizer.json, tiktoken BPE); default: the corpus's."""
    data_cache_path: Optional[str] = None
    """Where GPTDataset index caches go; default: <save>/data_cache or the corpus folder."""
    seq_length: int = 128
    make_vocab_size_divisible_by: int = 128


@dataclass
class TrainingSection:
    seed: int = 1234
    micro_batch_size: int = 8
    global_batch_size: int = 16
    train_iters: int = 100
    log_interval: int = 10
    eval_interval: int = 50
    eval_iters: int = 4
    fused_prefill_passes: int = 3
    """Validation reports the loss after 0, 1, …, n fused prefill passes (FBT models only)."""
    exit_interval: Optional[int] = None
    """Stop (after a checkpoint) once the iteration is a multiple of this; a later --load resumes."""
    threads: int = 0
    """torch intra-op threads per process (0: torch's default)."""


@dataclass
class PassesSection:
    """The pass-count schedule: k = ``passes`` before ``pass_mixture_start``, then drawn from
    ``pass_mixture`` (a pure function of seed and step, identical on every rank)."""

    passes: int = 1
    pass_mixture: Optional[Dict[int, float]] = None
    pass_mixture_start: int = 0


@dataclass
class OptimizerSection:
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 3e-3
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    lr_warmup_iters: int = 20
    lr_decay_style: Literal["WSD", "cosine", "linear", "constant"] = "WSD"
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"
    lr_wsd_decay_fraction: float = 0.25
    """WSD: the last fraction of training decays the learning rate to ``min_lr``."""
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None
    """fp16 only: a static loss scale; null means dynamic loss scaling."""


@dataclass
class ParallelSection:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    """Shard activations along the sequence across TP ranks (needs TP > 1)."""
    context_parallel_size: int = 1
    """Split every sequence over CP ranks in megatron-core's load-balanced chunks (needs Transformer
    Engine attention, i.e. a GPU)."""
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False


@dataclass
class CheckpointSection:
    save: Optional[str] = None
    """Run folder: checkpoints, metrics.jsonl and TensorBoard events."""
    load: Optional[str] = None
    """Run folder to resume from (its latest checkpoint)."""
    save_interval: Optional[int] = None
    tensorboard: bool = True
    create_seed_checkpoint: bool = False
    """Save the freshly initialised model as iteration 0 in --save and exit (one process). Runs at
    any parallel layout that --load it start from the same weights (initialisation itself
    depends on the pipeline layout, as in Megatron-LM)."""


SECTIONS = {
    "data": DataSection,
    "training": TrainingSection,
    "passes": PassesSection,
    "optimizer": OptimizerSection,
    "parallel": ParallelSection,
    "checkpoint": CheckpointSection,
}


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    model_overrides: Dict[str, Any] = field(default_factory=dict)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    passes: PassesSection = field(default_factory=PassesSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)

    def to_dict(self) -> dict:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        out["model"] = {"preset": self.model.preset, **self.model_overrides}
        return out

    def validate(self, world_size: int = 1) -> None:
        t, p, o = self.training, self.parallel, self.optimizer
        positive = [
            ("training.micro_batch_size", t.micro_batch_size),
            ("training.global_batch_size", t.global_batch_size),
            ("training.train_iters", t.train_iters),
            ("training.log_interval", t.log_interval),
            ("training.eval_interval", t.eval_interval),
            ("data.seq_length", self.data.seq_length),
            ("passes.passes", self.passes.passes),
            ("parallel.tensor_model_parallel_size", p.tensor_model_parallel_size),
            ("parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size),
            ("parallel.context_parallel_size", p.context_parallel_size),
        ]
        for key, value in positive:
            if value < 1:
                raise RecipeError(f"{key} must be >= 1, got {value}")
        if t.eval_iters < 0 or t.fused_prefill_passes < 0:
            raise RecipeError("training.eval_iters and training.fused_prefill_passes must be >= 0")
        if self.checkpoint.create_seed_checkpoint and (world_size != 1 or self.checkpoint.save is None):
            raise RecipeError("checkpoint.create_seed_checkpoint needs one process and --save")
        if self.checkpoint.save_interval is not None and self.checkpoint.save_interval < 1:
            raise RecipeError(f"checkpoint.save_interval must be >= 1, got {self.checkpoint.save_interval}")
        model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
        if world_size % model_parallel:
            raise RecipeError(
                f"tensor ({p.tensor_model_parallel_size}) x pipeline ({p.pipeline_model_parallel_size}) x context "
                f"({p.context_parallel_size}) parallel size does not divide the world size {world_size}"
            )
        dp = world_size // model_parallel
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise RecipeError(
                f"training.global_batch_size {t.global_batch_size} is not a multiple of "
                f"micro_batch_size {t.micro_batch_size} x data-parallel size {dp}"
            )
        micro = t.global_batch_size // (t.micro_batch_size * dp)
        if p.pipeline_model_parallel_size > 1 and micro % p.pipeline_model_parallel_size:
            raise RecipeError(
                f"{micro} microbatches per step (global batch / (micro batch x DP)) must be a multiple of "
                f"pipeline_model_parallel_size {p.pipeline_model_parallel_size}"
            )
        if p.pipeline_model_parallel_size > 1 and self.model_overrides.get("detach_feedback"):
            raise RecipeError("model.detach_feedback (an ablation) is not supported with pipeline parallelism")
        if p.sequence_parallel and p.tensor_model_parallel_size == 1:
            raise RecipeError("parallel.sequence_parallel needs tensor_model_parallel_size > 1")
        if p.sequence_parallel and self.data.seq_length % p.tensor_model_parallel_size:
            raise RecipeError(f"data.seq_length {self.data.seq_length} is not divisible by TP {p.tensor_model_parallel_size} (sequence parallel)")
        if p.context_parallel_size > 1:
            chunks = 2 * p.context_parallel_size * (p.tensor_model_parallel_size if p.sequence_parallel else 1)
            if self.data.seq_length % chunks:
                raise RecipeError(f"data.seq_length {self.data.seq_length} does not split into {chunks} equal chunks (context parallel)")
            if not platform.have_transformer_engine():
                raise RecipeError("parallel.context_parallel_size > 1 needs Transformer Engine attention (a CUDA machine with the GPU extras)")
        if o.bf16 and o.fp16:
            raise RecipeError("optimizer.bf16 and optimizer.fp16 are exclusive")
        if not 0 <= o.lr_wsd_decay_fraction <= 1:
            raise RecipeError(f"optimizer.lr_wsd_decay_fraction must be in [0, 1], got {o.lr_wsd_decay_fraction}")
        if not 0 <= o.lr_warmup_iters < t.train_iters:
            raise RecipeError(f"optimizer.lr_warmup_iters {o.lr_warmup_iters} must be in [0, train_iters {t.train_iters})")
        if o.min_lr > o.lr:
            raise RecipeError(f"optimizer.min_lr {o.min_lr} exceeds optimizer.lr {o.lr}")
        mixture = self.passes.pass_mixture
        if mixture is not None:
            if not mixture or any(k < 1 or w < 0 for k, w in mixture.items()) or sum(mixture.values()) <= 0:
                raise RecipeError(f"passes.pass_mixture must map pass counts >= 1 to weights >= 0, got {mixture}")
        if self.data.data_path is None and self.data.train_data_path is None:
            raise RecipeError("data: set data_path (a corpus folder) or train_data_path (a blend)")
        if self.data.train_data_path is not None and self.data.tokenizer_model is None:
            raise RecipeError("data.train_data_path needs data.tokenizer_model")


# ---------------------------------------------------------------- typed values
def _check(value, hint, key: str):
    """``value`` converted to the type ``hint``, or RecipeError naming ``key``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        return _check(value, [a for a in args if a is not type(None)][0], key)
    if origin is Literal:
        if value not in args:
            raise RecipeError(f"{key} must be one of {list(args)}, got {value!r}")
        return value
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{key} must be a list, got {value!r}")
        return [_check(v, args[0], key) for v in value] if args else list(value)
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise RecipeError(f"{key} must be a mapping, got {value!r}")
        return {_check(k, args[0], key): _check(v, args[1], key) for k, v in value.items()}
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise RecipeError(f"{key} must be a string, got {value!r}")
        return value
    if hint is tuple:
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{key} must be a list, got {value!r}")
        return tuple(value)
    raise RecipeError(f"{key}: cannot be set from a recipe")


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


_SIMPLE = (bool, int, float, str, tuple)


def _settable(hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return all(a is type(None) or _settable(a) for a in args)
    return origin is Literal or hint in _SIMPLE


def _model_hints() -> dict:
    """Type hints of the FBTConfig (and TransformerConfig) fields a recipe may set: simple-typed ones."""
    from fbt_megatron.config import FBTConfig

    owned = {name for cls in SECTIONS.values() for name in _hints(cls)} | {"vocab_size"}  # set elsewhere
    return {n: h for n, h in typing.get_type_hints(FBTConfig).items() if _settable(h) and n not in owned}


def _section(cls, values, where: str):
    if values is None:
        return cls()
    if not isinstance(values, dict):
        raise RecipeError(f"{where} must be a mapping")
    hints = _hints(cls)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise RecipeError(f"unknown key {where}.{unknown[0]} (known: {', '.join(sorted(hints))})")
    return cls(**{k: _check(v, hints[k], f"{where}.{k}") for k, v in values.items()})


def _model(values) -> tuple:
    values = dict(values or {})
    if not isinstance(values, dict):
        raise RecipeError("model must be a mapping")
    preset = _check(values.pop("preset", ModelSection.preset), str, "model.preset")
    hints = _model_hints()
    overrides = {}
    for key, value in values.items():
        if key not in hints:
            raise RecipeError(f"unknown key model.{key} (not an FBTConfig field a recipe can set)")
        overrides[key] = _check(value, hints[key], f"model.{key}")
    return ModelSection(preset=preset), overrides


def load_recipe(path: Optional[str]) -> Recipe:
    """Read and type-check a recipe file (None: all defaults)."""
    if path is None:
        raw = {}
    else:
        if not Path(path).is_file():
            raise RecipeError(f"recipe file not found: {path}")
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise RecipeError(f"{path}: a recipe is a mapping of sections")
    unknown = sorted(set(raw) - set(SECTIONS) - {"model"})
    if unknown:
        raise RecipeError(f"unknown recipe section {unknown[0]!r} (known: model, {', '.join(SECTIONS)})")
    model, overrides = _model(raw.get("model"))
    sections = {name: _section(cls, raw.get(name), name) for name, cls in SECTIONS.items()}
    return Recipe(model=model, model_overrides=overrides, **sections)


# ---------------------------------------------------------------- command line
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_override_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per recipe field (Megatron's names); values are parsed as YAML scalars/lists."""
    seen = set()
    groups = [(name, _hints(cls)) for name, cls in SECTIONS.items()]
    groups.append(("model", {"preset": str, **_model_hints()}))
    for section, hints in groups:
        group = parser.add_argument_group(f"{section} overrides")
        for name in hints:
            if name in seen:
                continue
            seen.add(name)
            group.add_argument(_flag(name), dest=f"{section}.{name}", default=None, metavar="VALUE")


def apply_overrides(recipe: Recipe, args: argparse.Namespace) -> Recipe:
    """The recipe with every flag given on the command line applied (and type-checked)."""
    for dest, text in vars(args).items():
        if "." not in dest or text is None:
            continue
        section, name = dest.split(".", 1)
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        where = _flag(name)
        if section == "model":
            if name == "preset":
                recipe.model.preset = _check(value, str, where)
            else:
                recipe.model_overrides[name] = _check(value, _model_hints()[name], where)
        else:
            target = getattr(recipe, section)
            setattr(target, name, _check(value, _hints(type(target))[name], where))
    return recipe
