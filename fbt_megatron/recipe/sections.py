"""A recipe's sections, one per concern, as typed dataclasses whose field names are Megatron-LM's
argument names (``train_iters`` ↔ ``--train-iters``); each checks its own values (``validate``:
one ``RecipeError`` line naming the key). The field docstrings are the flags' descriptions
(``flags``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Tuple

from fbt_megatron.common.errors import RecipeError


@dataclass
class ModelSection:
    preset: str = "tiny"
    """Model preset (fbt_megatron/model/config.py: tiny, fbt-1b); other model keys override its fields."""


@dataclass
class DataSection:
    data_path: Optional[str] = "data/stdlib-sp2048"
    """A prepared corpus folder (with corpus.json), or where to prepare ``corpus``."""
    corpus: Optional[str] = "stdlib"
    """Source to prepare ``data_path`` from on first use: ``stdlib`` (embedded), a folder, a JSONL
    file, a state-tracking task (``state_tracking:parity``, ``sum_mod5``, ``s3``) or, with --sft, the
    tiny chat set (``sft:stdlib``, ``sft:FOLDER`` of .py files); null: ``data_path`` must already be prepared."""
    vocab_size: int = 2048
    """Tokenizer size when the corpus is prepared here (it sets the embedding size too)."""
    train_data_path: Optional[List[Any]] = None
    """Megatron blend for training: [weight, prefix, weight, prefix, ...] or [prefix, ...]."""
    valid_data_path: Optional[List[Any]] = None
    """Megatron blend for validation (default: the training blend)."""
    tokenizer_model: Optional[str] = None
    """Tokenizer file (sentencepiece .model, tokenizer.json, tiktoken BPE); default: the corpus's."""
    data_cache_path: Optional[str] = None
    """Where GPTDataset index caches go; default: <save>/data_cache or the corpus folder."""
    seq_length: int = 128
    """Tokens per training sequence."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this (times TP)."""
    sft: bool = False
    """Supervised fine-tuning on chat JSONL ({"messages": [{"role": ..., "content": ...}, ...]}):
    train_data_path / valid_data_path are .jsonl files (or data_path a prepared SFT set), tokenised
    with the tokenizer's chat template and packed whole into rows (fbt_megatron/data/sft/); each
    conversation attends only to itself; loss on assistant tokens only."""
    sft_skip_bad_records: bool = False
    """SFT: skip (and count) bad records instead of stopping at the first with its file and line."""
    sft_prefix_mixin: Literal["prompt", "random"] = "prompt"
    """SFT: the fused passes keep plain embeddings on the prompt (system and user turns, up to each
    assistant turn: prompt-then-generate), or on a random prefix as in pretraining."""

    def validate(self) -> None:
        at_least_one("data", self, "seq_length")
        if self.data_path is None and self.train_data_path is None:
            raise RecipeError("data: set data_path (a corpus folder) or train_data_path (a blend)")
        if self.train_data_path is not None and self.tokenizer_model is None:
            raise RecipeError("data.train_data_path needs data.tokenizer_model")


@dataclass
class TrainingSection:
    seed: int = 1234
    """Seed of initialisation, data order, prefix mixin, jitter and the pass schedule."""
    micro_batch_size: int = 8
    """Sequences per microbatch on one data-parallel rank."""
    global_batch_size: int = 16
    """Sequences per optimizer step over all data-parallel ranks."""
    train_iters: int = 100
    """Optimizer steps of the whole run (the learning-rate schedule spans them)."""
    eval_interval: int = 50
    """Validate every this many steps (and at the end)."""
    eval_iters: int = 4
    """Global batches per validation (0: no validation)."""
    fused_prefill_passes: int = 3
    """Validation reports the loss after 0, 1, ..., n fused prefill passes (FBT models only)."""
    exit_interval: Optional[int] = None
    """Stop (after a checkpoint) once the iteration is a multiple of this; a later --load resumes."""
    exit_duration_in_mins: Optional[float] = None
    """Stop (after a checkpoint, exit 0) at the first step boundary after this many minutes of training."""
    exit_signal_handler: bool = True
    """On SIGTERM or SIGINT (Ctrl-C, Slurm's pre-timeout signal, scontrol requeue), all ranks stop at
    a step boundary, save a checkpoint and exit 0; a second Ctrl-C aborts."""
    max_bad_steps: int = 5
    """A step with a NaN/Inf loss or gradient norm is skipped (no update) and counted; more than this
    many in a row stop the run (exit 2), its last good checkpoint intact."""
    threads: int = 0
    """torch intra-op threads per process (0: torch's default)."""
    z_loss_coeff: float = 0.0
    """c of the z-loss c·(log Σ exp logits)² added to every pass's next-token loss (paper: 1e-5)."""
    z_loss_from: Literal["cooldown", "start"] = "cooldown"
    """When the z-loss is on: in the learning-rate cooldown only (the paper), or from the first step."""
    dry_run: bool = False
    """Print the plan (parameters, steps, layout, memory, FLOPs, wall time: fbt_megatron.plan) and exit."""
    inject_nan: Optional[str] = None
    """Testing aid: NaN/Inf at chosen steps, e.g. "loss@3,grad@5-6,grad@9:inf" (bad_steps.py)."""
    inject_fault: Optional[List[str]] = None
    """Drill, repeatable: KIND@STEP[:RANK], KIND one of crash, hang, freeze, slow, spike (docs/operations.md).
    crash@STEP[:RANK] kills the rank (kill -9), hang@ blocks it before the next collective, freeze@ too
    holding the interpreter (it writes nothing), slow@ adds 1 s to each of 10 steps (a straggler);
    spike@STEP scales the step's loss and gradients up (fbt_megatron/trainer/callbacks/faults.py)."""
    distributed_timeout_minutes: int = 10
    """Timeout of the process groups' collectives, minutes (at least the hang watchdog's + 2)."""
    hang_timeout_minutes: float = 30.0
    """No step progress for this long (step, validation and checkpoint included): every rank writes its
    Python stacks to <save>/hang/ and the run exits 124, which a Slurm job restarts (0: no watchdog)."""
    spike_policy: Literal["off", "warn", "skip", "rewind"] = "warn"
    """A step whose gradient norm exceeds --spike-factor × the median of the last --spike-window steps' is
    logged (warn), not applied (skip), or rewound: the last checkpoint reloaded, the batches since skipped."""
    spike_factor: float = 10.0
    """How many times the running median gradient norm a spike is."""
    spike_window: int = 20
    """Gradient norms in the running median; detection starts once it is full."""
    max_rewinds: int = 3
    """Rewinds of the whole run (--spike-policy rewind); later spikes are skipped."""

    def validate(self) -> None:
        at_least_one("training", self, "micro_batch_size", "global_batch_size", "train_iters", "eval_interval")
        if self.eval_iters < 0 or self.fused_prefill_passes < 0:
            raise RecipeError("training.eval_iters and training.fused_prefill_passes must be >= 0")
        if self.max_bad_steps < 0:
            raise RecipeError(f"training.max_bad_steps must be >= 0, got {self.max_bad_steps}")
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise RecipeError(f"training.exit_duration_in_mins must be > 0, got {self.exit_duration_in_mins}")
        nan_injections(self.inject_nan)  # a malformed spec: one error line before any work
        for name, rule, holds in (("distributed_timeout_minutes", ">= 1", self.distributed_timeout_minutes >= 1),
                                  ("hang_timeout_minutes", ">= 0", self.hang_timeout_minutes >= 0),
                                  ("spike_factor", "> 1", self.spike_factor > 1), ("spike_window", ">= 1", self.spike_window >= 1),
                                  ("max_rewinds", ">= 0", self.max_rewinds >= 0)):
            if not holds:
                raise RecipeError(f"training.{name} must be {rule}, got {getattr(self, name)}")
        if self.z_loss_coeff < 0:
            raise RecipeError(f"training.z_loss_coeff must be >= 0, got {self.z_loss_coeff}")


@dataclass
class PassesSection:
    """The pass-count schedule in phases: k = ``passes`` from the first step, then each of
    ``pass_phases`` from its fraction of training on (a pure function of seed and step, identical
    on every rank)."""

    passes: int = 1
    """Passes k per step in the first phase (until the first of pass_phases starts)."""
    pass_phases: Optional[List[Dict[str, Any]]] = None
    """Later phases, each from a fraction of --train-iters on, with a fixed k or k drawn per step
    from weights: [{start: 0.75, mixture: {1: 0.75, 2: 0.22, 3: 0.03}}] or [{start: 0.5, passes: 2}]."""

    def validate(self) -> None:  # the phases need --train-iters: Recipe.pass_phases
        at_least_one("passes", self, "passes")


@dataclass
class OptimizerSection:
    optimizer: Literal["adam", "sgd", "normuon"] = "adam"
    """adam or sgd: megatron-core's, for every parameter; normuon: NorMuon for the 2-D weight
    matrices, Adam for the rest (fbt_megatron/optimizers). Weight decay is off for norms and 1-D
    parameters."""
    lr: float = 3e-3
    """Peak learning rate (with normuon: NorMuon's, for the matrices)."""
    adam_lr: Optional[float] = None
    """normuon only: the peak learning rate of the parameters Adam updates; null: --lr."""
    adam_params: List[str] = field(default_factory=list)
    """normuon only: glob patterns of further parameter names for Adam instead of NorMuon (the
    embeddings, norms, headwise gates and 1-D parameters always are), e.g. ['*feedback_fusion*']."""
    muon_momentum: float = 0.95
    """NorMuon's (Nesterov) momentum."""
    muon_num_ns_steps: int = 5
    """Newton–Schulz iterations that orthogonalise the update."""
    muon_tp_mode: Literal["duplicated", "blockwise"] = "duplicated"
    """Tensor-parallel matrices: duplicated (gather the shards, orthogonalise the whole matrix, keep
    this rank's part) or blockwise (orthogonalise each rank's shard alone)."""
    muon_split_qkv: bool = True
    """Orthogonalise the fused QKV matrix per Q, K and V."""
    normuon_beta2: float = 0.95
    """Decay of NorMuon's per-row second moment of the orthogonalised update."""
    weight_decay_schedule: Literal["constant", "adamc"] = "constant"
    """adamc: in the cooldown, the weight decay of the normalised layers' matrices is scaled by
    lr_t / lr_max (Defazio's AdamC), for both optimizer families."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay of matrices."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.95
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""
    sgd_momentum: float = 0.9
    """SGD momentum."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0: off)."""
    lr_warmup_iters: int = 20
    """Linear warmup steps; clamped to a tenth of the run when the run is not longer (printed)."""
    lr_decay_style: Literal["WSD", "cosine", "linear", "constant"] = "WSD"
    """Learning-rate schedule after warmup (megatron-core's OptimizerParamScheduler)."""
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"
    """WSD: the shape of the final decay."""
    lr_wsd_decay_fraction: float = 0.25
    """WSD: the last fraction of training decays the learning rate to ``min_lr``."""
    bf16: bool = False
    """bf16 weights and activations (fp32 main weights in the optimizer)."""
    fp16: bool = False
    """fp16 weights and activations with loss scaling."""
    loss_scale: Optional[float] = None
    """fp16 only: a static loss scale; null means dynamic loss scaling."""

    def validate(self) -> None:
        if self.bf16 and self.fp16:
            raise RecipeError("optimizer.bf16 and optimizer.fp16 are exclusive")
        if not 0 <= self.lr_wsd_decay_fraction <= 1:
            raise RecipeError(f"optimizer.lr_wsd_decay_fraction must be in [0, 1], got {self.lr_wsd_decay_fraction}")
        if self.lr <= 0:
            raise RecipeError(f"optimizer.lr must be > 0, got {self.lr}")
        if self.lr_warmup_iters < 0:
            raise RecipeError(f"optimizer.lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}")
        if self.min_lr > self.lr:
            raise RecipeError(f"optimizer.min_lr {self.min_lr} exceeds optimizer.lr {self.lr}")
        if self.optimizer != "normuon" and (self.adam_lr is not None or self.adam_params):
            raise RecipeError("optimizer.adam_lr and optimizer.adam_params are for --optimizer normuon")
        if self.adam_lr is not None and self.adam_lr <= 0:
            raise RecipeError(f"optimizer.adam_lr must be > 0, got {self.adam_lr}")
        at_least_one("optimizer", self, "muon_num_ns_steps")


@dataclass
class ParallelSection:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (megatron-core's column/row-parallel layers)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages; the k passes run as virtual chunks of each stage."""
    sequence_parallel: bool = False
    """Shard activations along the sequence across TP ranks (needs TP > 1)."""
    context_parallel_size: int = 1
    """Split every sequence over CP ranks in megatron-core's load-balanced chunks (needs Transformer
    Engine attention, i.e. a GPU)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (megatron-core's distributed optimizer)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the last backward."""

    def validate(self) -> None:  # against the world, batch and sequence: Recipe.validate
        at_least_one("parallel", self, "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise RecipeError("parallel.sequence_parallel needs tensor_model_parallel_size > 1")


@dataclass
class CheckpointSection:
    save: Optional[str] = None
    """Run folder: checkpoints, metrics.jsonl and TensorBoard events."""
    overwrite_save: bool = False
    """Start a new run in a --save folder that holds another run (its checkpoints, metrics.jsonl,
    exit status) without resuming it: replaced as the new run writes. Without it such a start is
    refused (resume it with --load FOLDER, or choose another --save)."""
    load: Optional[str] = None
    """Run folder to resume from (its newest checkpoint, or --ckpt-step)."""
    ckpt_step: Optional[int] = None
    """Resume from this iteration's checkpoint of --load instead of the newest one."""
    save_interval: Optional[int] = None
    """Save every this many steps (and always at the end)."""
    override_opt_param_scheduler: bool = False
    """On resume, apply this run's learning-rate schedule (--lr, --train-iters, warmup, decay) instead of the checkpoint's."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, keep the checkpoint's learning-rate schedule even where this run's flags differ."""
    pretrained_checkpoint: Optional[str] = None
    """Run folder whose latest weights start this run (a stage) while --load holds no checkpoint yet:
    any layout, same shapes (RoPE base, sequence length may change); iteration 0, fresh optimizer."""
    finetune: bool = False
    """Load only the weights of --load's checkpoint and start at iteration 0 (Megatron-LM's --finetune)."""
    no_load_optim: bool = False
    """On resume, do not load the optimizer state (fresh moments; the step count is kept)."""
    no_load_rng: bool = False
    """On resume, do not restore the RNG streams."""
    keep_last_n_checkpoints: int = 0
    """Keep only the newest this many checkpoints in --save (0: keep all)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues (megatron-core's async save)."""
    create_seed_checkpoint: bool = False
    """Save the freshly initialised model as iteration 0 in --save and exit (one process). Runs at
    any parallel layout that --load it start from the same weights (initialisation itself
    depends on the pipeline layout, as in Megatron-LM)."""

    def validate(self) -> None:
        if self.save_interval is not None and self.save_interval < 1:
            raise RecipeError(f"checkpoint.save_interval must be >= 1, got {self.save_interval}")
        if self.keep_last_n_checkpoints < 0:
            raise RecipeError(f"checkpoint.keep_last_n_checkpoints must be >= 0, got {self.keep_last_n_checkpoints}")
        if self.ckpt_step is not None and self.load is None:
            raise RecipeError("checkpoint.ckpt_step picks a checkpoint of --load: give --load too")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise RecipeError("override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are exclusive: pick one")


@dataclass
class LoggingSection:
    log_interval: int = 10
    """Log every this many steps (and the last step): stdout, metrics.jsonl, TensorBoard."""
    tensorboard: bool = True
    """Write TensorBoard scalars (needs --save or --tensorboard-dir)."""
    tensorboard_dir: Optional[str] = None
    """TensorBoard event folder (default: <save>/tensorboard)."""
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one accelerator in the run's precision, for MFU in the logs (default:
    looked up from the GPU's name; no MFU on CPU)."""
    wandb_project: Optional[str] = None
    """Also log to this Weights & Biases project: the TensorBoard scalars (needs ``pip install wandb``;
    --wandb-mode offline writes the run to disk only)."""
    wandb_exp_name: Optional[str] = None
    """The W&B run's name (default: the --save folder's name)."""
    wandb_save_dir: Optional[str] = None
    """Where W&B writes its local files (default: <save>/wandb)."""
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = None
    """W&B's mode (null: WANDB_MODE's, else online). Online needs an API key (WANDB_API_KEY, or wandb
    login); offline writes under --wandb-save-dir only (wandb sync uploads it later)."""
    log_layer_norms_interval: int = 0
    """Every this many steps (a multiple of --log-interval; 0: never) the record also holds each
    layer's parameter and gradient norms (params-norm/NAME, grad-norm/NAME), exact under TP and PP."""
    straggler_threshold: float = 1.5
    """Name the ranks slower than this many times the median at every logged step (0: off). A rank's
    time is its own part of each step since the last log; the names go to the log, metrics.jsonl,
    W&B and <save>/stragglers.jsonl."""
    heartbeat_interval: float = 30.0
    """Seconds between rewrites of <save>/heartbeat.json for cluster monitors (0: every step). (It holds
    the step, time, tokens and last checkpoint, written atomically.)"""
    log_timestamps: bool = False
    """Every log line opens with its UTC time. (Off: only the steps' lines, ISO 8601; the other lines
    read as they are, for tools that parse them. On: a whole log lines up with a cluster's events.)"""

    def validate(self) -> None:
        at_least_one("logging", self, "log_interval")
        if self.log_layer_norms_interval < 0 or self.log_layer_norms_interval % self.log_interval:
            raise RecipeError(f"logging.log_layer_norms_interval must be a multiple of --log-interval {self.log_interval} "
                              f"(0: off), got {self.log_layer_norms_interval}")
        if self.heartbeat_interval < 0:
            raise RecipeError(f"logging.heartbeat_interval must be >= 0 seconds, got {self.heartbeat_interval}")
        if self.straggler_threshold != 0 and self.straggler_threshold <= 1:
            raise RecipeError(f"logging.straggler_threshold must be > 1 (0: off), got {self.straggler_threshold}")
        if self.wandb_project is None and (self.wandb_exp_name or self.wandb_save_dir or self.wandb_mode):
            raise RecipeError("logging.wandb_exp_name, wandb_save_dir and wandb_mode are a W&B run's: give --wandb-project too")


SECTIONS = {
    "data": DataSection,
    "training": TrainingSection,
    "passes": PassesSection,
    "optimizer": OptimizerSection,
    "parallel": ParallelSection,
    "checkpoint": CheckpointSection,
    "logging": LoggingSection,
}


def at_least_one(section: str, obj, *names: str) -> None:
    """RecipeError for the first of ``names`` (fields of ``obj``, the recipe's ``section``) below 1."""
    for name in names:
        if getattr(obj, name) < 1:
            raise RecipeError(f"{section}.{name} must be >= 1, got {getattr(obj, name)}")


_INJECTION = re.compile(r"^(loss|grad)@(\d+)(?:-(\d+))?(?::(nan|inf))?$")


def nan_injections(spec: Optional[str]) -> Dict[int, Tuple[str, float]]:
    """``--inject-nan`` (a testing aid, ``bad_steps.NaNInjection``) as step → (what, factor):
    "loss@3,grad@5-6,grad@9:inf" → {3: ("loss", nan), 5: ("grad", nan), 6: ("grad", nan), 9: ("grad", inf)}."""
    steps: Dict[int, Tuple[str, float]] = {}
    for item in filter(None, (spec or "").replace(" ", "").split(",")):
        m = _INJECTION.match(item)
        if not m:
            raise RecipeError(f"training.inject_nan: {item!r} is not WHAT@STEP[-LAST][:nan|inf] (WHAT: loss or grad)")
        first = int(m.group(2))
        for step in range(first, int(m.group(3) or first) + 1):
            steps[step] = (m.group(1), float(m.group(4) or "nan"))
    return steps
