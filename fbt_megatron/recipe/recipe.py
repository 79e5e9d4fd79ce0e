"""The recipe: its sections (``sections``), the model's overrides (``FBTConfig`` fields under
``model:``), and what holds across sections (``validate``: parallel sizes that fit the world, the
pass phases, the model megatron-core can build, a writable ``--save``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.common.folders import check_writable
from fbt_megatron.recipe.sections import (
    SECTIONS, CheckpointSection, DataSection, LoggingSection, ModelSection, OptimizerSection, ParallelSection, PassesSection,
    TrainingSection,
)
from fbt_megatron.recipe.values import check
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
    logging: LoggingSection = field(default_factory=LoggingSection)

    def to_dict(self) -> dict:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        out["model"] = {"preset": self.model.preset, **self.model_overrides}
        return out

    def clamp_warmup(self) -> Optional[str]:
        """A warmup as long as the run (a short smoke run of a long recipe) becomes a tenth of the
        run; returns the note to print, None when nothing changed."""
        o, iters = self.optimizer, self.training.train_iters
        if o.lr_warmup_iters < iters:
            return None
        asked, o.lr_warmup_iters = o.lr_warmup_iters, iters // 10
        return (f"note: --lr-warmup-iters {asked} does not fit --train-iters {iters}: warmup clamped to "
                f"{o.lr_warmup_iters} steps (a tenth of the run)")

    def pass_phases(self) -> List[tuple]:
        """The pass schedule's phases as (first step, {k: weight}), checked: the first phase is
        ``passes`` from step 0, then ``pass_phases`` at round(start × train_iters)."""
        iters, phases = self.training.train_iters, [(0, {self.passes.passes: 1.0})]
        for i, phase in enumerate(self.passes.pass_phases or []):
            key = f"passes.pass_phases[{i}]"
            if not isinstance(phase, dict) or set(phase) not in ({"start", "passes"}, {"start", "mixture"}):
                raise RecipeError(f"{key} must be {{start: fraction, passes: k}} or {{start: fraction, mixture: {{k: weight}}}}, got {phase!r}")
            start = check(phase["start"], float, f"{key}.start")
            if not 0 <= start < 1:
                raise RecipeError(f"{key}.start is a fraction of --train-iters in [0, 1), got {start}")
            if "passes" in phase:
                mixture = {check(phase["passes"], int, f"{key}.passes"): 1.0}
            else:
                mixture = check(phase["mixture"], Dict[int, float], f"{key}.mixture")
            if not mixture or any(k < 1 or w < 0 for k, w in mixture.items()) or sum(mixture.values()) <= 0:
                raise RecipeError(f"{key} must map pass counts >= 1 to weights >= 0, got {mixture}")
            if abs(sum(mixture.values()) - 1) > 1e-6:  # a typo would otherwise be renormalized silently
                raise RecipeError(f"{key}.mixture weights sum to {sum(mixture.values()):g}, not 1: they are the shares of "
                                  f"steps with each k; fix them to sum to 1")
            step = round(start * iters)
            if step <= phases[-1][0] and (i or step):
                raise RecipeError(f"{key}.start {start} must come after the previous phase's start (step {step} of {iters})")
            phases = phases[:-1] if step == 0 else phases  # a phase from the start replaces ``passes``
            phases.append((step, mixture))
        return phases

    def model_config(self):
        """The model's config at this recipe's TP / SP / CP (under CP, Transformer Engine's
        communication type is chosen there: ``config.windowed_cp_comm_type``); a model field the
        config refuses is a RecipeError."""
        from fbt_megatron.model.config import recipe_config

        p = self.parallel
        try:
            return recipe_config(self, tensor_model_parallel_size=p.tensor_model_parallel_size,
                                 sequence_parallel=p.sequence_parallel, context_parallel_size=p.context_parallel_size)
        except ValueError as e:
            raise RecipeError(f"model: {e}") from None

    def _validate_model(self, this_machine: bool) -> None:
        """The model's config builds, its FP8 settings hold for the schedule's largest k
        (``model.te_calls``), and FP8 has Transformer Engine on this machine."""
        from fbt_megatron.model import te_calls

        config, most = self.model_config(), max(k for _, mixture in self.pass_phases() for k in mixture)
        try:
            te_calls.check_pass_count(config, most)
        except ValueError as e:
            raise RecipeError(f"model: {e}") from None
        if config.fp8 and this_machine and not _have_transformer_engine():
            raise RecipeError(f"model.fp8 {config.fp8} needs Transformer Engine (a CUDA machine in the project's image): "
                              "without it the GEMMs would run in full precision; drop --fp8 here")

    def validate(self, world_size: int = 1, this_machine: bool = True) -> None:
        """RecipeError for the first thing wrong: each section's own values, then what the sections
        decide together at ``world_size`` processes; ``this_machine=False`` (planning a run for other
        machines) skips what only this machine decides (Transformer Engine for CP, W&B's package and
        key, a writable ``--save``)."""
        for name in SECTIONS:
            getattr(self, name).validate()
        t, c = self.training, self.checkpoint
        if c.create_seed_checkpoint and (world_size != 1 or c.save is None):
            raise RecipeError("checkpoint.create_seed_checkpoint needs one process and --save")
        from fbt_megatron.recipe.faults import check_faults

        check_faults(t, world_size)
        self._validate_layout(world_size, this_machine)
        self._validate_model(this_machine)
        if this_machine:
            self._validate_machine()

    def _validate_machine(self) -> None:
        """What this machine must provide: W&B's package and an API key for an online run, a
        ``--save`` folder it can write in now (not a file, a full disk or a read-only file system)."""
        from fbt_megatron.recipe.wandb_check import check_wandb

        if self.logging.wandb_project is not None:
            check_wandb(self.logging)
        if self.checkpoint.save is not None:
            check_writable(self.checkpoint.save, "--save")

    def _validate_layout(self, world_size: int, this_machine: bool) -> None:
        """The parallel sizes against the world, the batch, the sequence and the model."""
        t, p, seq = self.training, self.parallel, self.data.seq_length
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
        if p.sequence_parallel and seq % p.tensor_model_parallel_size:
            raise RecipeError(f"data.seq_length {seq} is not divisible by TP {p.tensor_model_parallel_size} (sequence parallel)")
        if p.context_parallel_size > 1:
            if self.data.sft:
                raise RecipeError("--sft packs conversations into rows, which context parallelism would split: use "
                                  "--context-parallel-size 1")
            chunks = 2 * p.context_parallel_size * (p.tensor_model_parallel_size if p.sequence_parallel else 1)
            if seq % chunks:
                raise RecipeError(f"data.seq_length {seq} does not split into {chunks} equal chunks (context parallel)")
            if this_machine and not _have_transformer_engine():
                raise RecipeError("parallel.context_parallel_size > 1 needs Transformer Engine attention (a CUDA machine with the GPU extras)")


def _have_transformer_engine() -> bool:
    """``common.platform``'s answer, imported when asked: the recipe and its flags load without torch
    (``--help`` in a second)."""
    from fbt_megatron.common import platform

    return platform.have_transformer_engine()
