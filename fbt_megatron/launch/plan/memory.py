"""Peak memory of one training rank, estimated from the model's shapes and the parallel layout.

Terms (bytes), for one pipeline stage:

* **weights**: its parameters in the run's dtype (bf16/fp16: 2 bytes, else 4);
* **gradients**: megatron DDP's gradient buffer, fp32 (``grad_reduce_in_fp32``): 4 bytes/parameter;
* **optimizer**: fp32 main weights when the weights are bf16/fp16 (4), and the state: Adam 8
  (two moments), SGD 4 (momentum), NorMuon 4 (momentum) per matrix parameter plus 4 per output
  row (the per-row second moment), Adam's 8 for the rest; divided by DP with the distributed optimizer;
* **activations**: what autograd keeps for backward at the step's peak (below);
* **logits** are part of the activations of the last stage (fp32 cross-entropy, 4·b·s·V/TP per
  pass held) and listed on their own.

Activations per microbatch and pass (n = b·s/CP tokens, e = activation bytes, e_n the bytes of
what norms keep: 4 with the local spec's torch norms, which keep FP32 copies, e with Transformer
Engine's; TP shards what the layer computes per head or per FFN unit, and the D-wide tensors only
under SP), counted for megatron-core's local spec and calibrated against ``SavedActivations`` on
CPU in FP32 and BF16 (tests/test_plan.py):

    layer  = n·(e_n·10·D/sp + e·(5·F + 6·h·d + 4·g·d + 2·h + 2·h·d [GQA: K/V expanded])/tp + 4·6)
             + attention: local (unfused) b·h/tp·s²·(4 + e if half) (FP32 softmax, half probabilities)
                          + s² (mask); Transformer Engine (flash) 4·b·h/tp·s (log-sum-exp)
    first stage + n·e·D (embeddings); fused pass + n·((2·e_n + 4·e)·D/sp + e) (the fusion)
    last stage  + n·e_n·(2·D + 3) (final norm) + 4·n·V/tp (FP32 logits in the cross-entropy)

A step of k passes at PP = 1 holds all k passes (k·A + (k−1)·fusion). With ``recompute_passes``
only the passes' inputs stay (e_t, and s^{(j−1)} for j ≥ 2: 2k − 3 tensors of n·D, none when
offloaded) and the last pass is not recomputed (A + fusion). Full recompute keeps each layer's
input (n·D, none when offloaded) and one layer's activations during backward. Under PP the k
passes are virtual chunks of megatron's interleaved schedule: rank r holds up to
2(PP − r − 1) + (k − 1)·PP + 1 chunks (1F1B at k = 1: PP − r microbatches) — an estimate from the
schedule's warmup count, not measured here. Transient buffers (a GEMM's output before it is saved,
the logits' gradient, communication buffers, allocator fragmentation) are not counted: keep some
headroom (the planner refuses at 100% of the GPU's memory and warns above 90%).

A process on CPU (no GPU: the rehearsal, the tests) holds everything in its RSS, and three terms more,
measured with a sampler of RSS and the main thread's stack on fbt-1b at full width and vocabulary
(2, 6 and 12 layers, 256 tokens, NorMuon + Adam, FP32), and with glibc's ``mallinfo2`` beside them at
the rehearsal's CI size (1 and 4 layers, vocabulary 2,048, 32 tokens, TP 1 and 2; docs/planning.md):

* **runtime**: the interpreter, torch and megatron-core (0.4 GiB before the model is built, at TP 1
  and 2) and what the allocator keeps: ≈ 0.15 GiB (``RUNTIME`` bytes together; fitted: ≈ 0.1 at TP 2,
  0.2 at TP 1) and a third of a layer's FP32 matrices (whole: the same at TP 2) per layer of the stage
  (``RETAINED_PER_LAYER``; 0.047 GiB at fbt-1b's width). glibc serves tensors under its mmap
  threshold (32 MiB at most) from its heap and keeps what they leave free there: at the step's peak
  the heap's free bytes grew by ≈ 0.05 GiB per layer (1 → 4 layers), and the process's RSS beyond
  its tensors by 0.047–0.058 GiB per layer (1 → 4 layers at TP 1 and 2, 2 → 12 layers at full size),
  the same at TP 2 as at TP 1 (not measured why; likely NorMuon's owner working on whole matrices,
  and shards falling under the threshold that whole matrices exceed). A constant 0.7 GiB was
  0.13–0.2 GiB over at one layer, TP 2 (0.50–0.57 GiB measured: the rehearsal's reshard check at
  0.81–0.85×) and 0.4–1.4 GiB under at 12–24 layers;
* **transients**: the larger of 2 · 4·V·D/TP on a stage that holds the embedding and, with NorMuon,
  5 · 4 bytes of its largest matrix (whole: NorMuon gathers TP shards). Without Transformer Engine's
  gradient-accumulation fusion the tied output layer's weight gradient is a tensor of its own, held by
  autograd until the embedding's gradient arrives at the end of backward (and that one is dense); in
  the optimizer step torch's single-tensor Adam makes two temporaries the size of its largest tensor,
  the embedding, and NorMuon about five of a matrix (the Nesterov update, the Newton–Schulz iterate,
  the normalised and the scaled direction, the QKV join): at TP 2 the owner of FC1 adds 0.381 GiB
  of mmapped memory in the step, five whole FC1, the other rank 0.15–0.25 GiB;
* **checkpoint copies** (``--async-save``): megatron-core's writer clones the CPU tensors that are
  views (the distributed optimizer's FP32 views of the weights and the model's split QKV/FC1 views),
  together the size of the stage's weights but the embedding, held until the save is finalized after
  the next step. A blocking save frees them before the next step: it counts only what they exceed the
  step's activations and transients by (its peak is the larger of the step's and the save's); so does
  a run whose only save follows its only step (the rehearsal's reshard stage), async or not. On a
  GPU they are host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict


@dataclass
class Layout:
    """What the estimate needs besides the model config: the parallel layout and the batch."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    seq_length: int = 128
    microbatches: int = 1
    optimizer: str = "adam"
    distributed_optimizer: bool = True
    half: bool = False  # bf16/fp16 weights and activations
    transformer_engine: bool = False  # TE spec (GPU): flash attention, norms that keep half-precision inputs
    cpu: bool = False  # a process on CPU: its RSS holds the process terms below (module docstring)
    async_save: bool = False


RUNTIME = 0.55 * 2**30  # bytes of a CPU process's interpreter and libraries (0.4 GiB) and allocator (module docstring)
RETAINED_PER_LAYER = 1 / 3  # of the FP32 bytes of a layer's matrices, whole: what the allocator keeps per layer on CPU


@dataclass
class Stage:
    """One pipeline stage's parameters (per rank, TP shards) and what it holds besides its layers."""

    rank: int
    layers: int
    params: int
    matrix_params: int  # 2-D weights NorMuon would update (decoder and fusion matrices)
    matrix_rows: int  # their output rows (NorMuon's second moment)
    embedding_params: int  # the word embedding's (or the tied output layer's) on this rank
    largest_matrix: int  # the largest of the matrices, whole (NorMuon orthogonalises it gathered)
    first: bool
    last: bool


@dataclass
class Estimate:
    terms: Dict[str, float] = field(default_factory=dict)  # bytes
    logits: float = 0.0  # bytes of the activations that are logits (included in "activations")
    stage: int = 0  # the pipeline stage (rank) estimated

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def state_bytes(stage: Stage, layout: Layout) -> Dict[str, float]:
    """weights, gradients and optimizer bytes of a stage's rank."""
    p = stage.params
    main = 4 * p if layout.half else 0
    if layout.optimizer == "sgd":
        state = 4 * p
    elif layout.optimizer == "normuon":
        state = 4 * stage.matrix_params + 4 * stage.matrix_rows + 8 * (p - stage.matrix_params)
    else:
        state = 8 * p
    shard = layout.dp if layout.distributed_optimizer else 1
    return {"weights": (2 if layout.half else 4) * p, "gradients": 4 * p, "optimizer": (main + state) / shard}


def layer_activations(config, layout: Layout) -> float:
    """Bytes one layer keeps for backward for one microbatch and pass (module docstring)."""
    c, t = config, layout.tp
    sp = t if layout.sequence_parallel else 1
    n, e, e_n = layout.micro_batch_size * layout.seq_length / layout.cp, *_element_bytes(layout)
    d, h = c.kv_channels, c.num_attention_heads
    g = c.num_query_groups or h
    per_head = 6 * h * d + 4 * g * d + 2 * h + (2 * h * d if g < h else 0)
    linear = n * (e_n * 10 * c.hidden_size / sp + e * (5 * c.ffn_hidden_size + per_head) / t + 4 * 6)
    s, b = layout.seq_length / layout.cp, layout.micro_batch_size
    if layout.transformer_engine:
        core = 4 * b * h / t * s
    else:
        core = b * h / t * s * s * (4 + (e if layout.half else 0)) + s * s
    return linear + core


def _element_bytes(layout: Layout) -> tuple:
    """(e, e_n): bytes of an activation element, and of what the norms keep (module docstring)."""
    e = 2 if layout.half else 4
    return e, 4 if not layout.transformer_engine else e


def activations(config, layout: Layout, stage: Stage, passes: int) -> Estimate:
    """Peak activation bytes of a stage's rank for a step of ``passes`` passes (module docstring)."""
    c, k = config, passes
    sp = layout.tp if layout.sequence_parallel else 1
    n, e, e_n = layout.micro_batch_size * layout.seq_length / layout.cp, *_element_bytes(layout)
    hidden = n * e * c.hidden_size / sp  # one [s, b, D] tensor
    layer = layer_activations(c, layout)
    logits = 4 * n * c.vocab_size / layout.tp if stage.last else 0.0
    edges = (n * e * c.hidden_size if stage.first else 0.0) + (n * e_n * (2 * c.hidden_size + 3) + logits if stage.last else 0.0)
    fusion = n * ((2 * e_n + 4 * e) * c.hidden_size / sp + e) if stage.first and c.latent_feedback and k > 1 else 0.0
    kept = 0.0 if c.offload_recompute_inputs else 1.0
    full = c.recompute_granularity == "full"
    # one pass (chunk) of one microbatch: all layers' activations, or (full recompute) their inputs
    chunk = stage.layers * hidden * kept + max(layer, edges) if full else stage.layers * layer + edges
    if layout.pp == 1:
        chunks, held_logits = k, k
    else:
        warmup = 2 * (layout.pp - stage.rank - 1) + (k - 1) * layout.pp if k > 1 else layout.pp - stage.rank - 1
        chunks = min(layout.microbatches * k, warmup + 1)
        held_logits = chunks
    fused = (k - 1) / k * chunks
    if c.recompute_passes and k > 1:
        inputs = (2 * k - 3) * hidden * kept if layout.pp == 1 else (chunks - 1) * hidden * (1 + kept * stage.first)
        total = chunk + fusion + inputs
        held_logits = 1
    elif full:
        # every chunk but the one in backward keeps its edges (logits), layer inputs and fusion
        total = (chunks - 1) * (edges + stage.layers * hidden * kept) + fused * fusion + chunk
    else:
        total = chunks * chunk + fused * fusion
    return Estimate({"activations": total}, logits=logits * held_logits)


def layer_matrix_params(config) -> int:
    """A decoder layer's QKV, projection, FC1 and FC2 weights, whole (not TP shards)."""
    c = config
    d, h, g = c.kv_channels, c.num_attention_heads, c.num_query_groups or c.num_attention_heads
    fc1 = (2 if c.gated_linear_unit else 1) * c.ffn_hidden_size
    return c.hidden_size * (h * d + 2 * g * d) + h * d * c.hidden_size + (fc1 + c.ffn_hidden_size) * c.hidden_size


def process_bytes(stage: Stage, layout: Layout, config) -> Dict[str, float]:
    """What a training process on CPU holds besides its tensors (module docstring); none on a GPU."""
    if not layout.cpu:
        return {}
    retained = RETAINED_PER_LAYER * 4 * layer_matrix_params(config) * stage.layers
    normuon = 5 * 4 * stage.largest_matrix if layout.optimizer == "normuon" else 0
    return {"runtime": RUNTIME + retained, "transients": max(2 * 4 * stage.embedding_params, normuon)}


def checkpoint_copies(stage: Stage, layout: Layout, step_peak: float) -> Dict[str, float]:
    """The async writer's copies on CPU (module docstring): all of them beside the step's ``step_peak``
    (activations and transients) with ``--async-save``, what they exceed it by with a blocking save."""
    if not layout.cpu:
        return {}
    copies = ((2 if layout.half else 4) + 4) / 2 * (stage.params - stage.embedding_params)
    return {"checkpoint copies": copies if layout.async_save else max(0.0, copies - step_peak)}


def estimate(config, layout: Layout, stage: Stage, passes: int) -> Estimate:
    """All terms of a stage's rank at a step of ``passes`` passes."""
    act = activations(config, layout, stage, passes)
    process = process_bytes(stage, layout, config)
    step_peak = act.terms["activations"] + process.get("transients", 0.0)
    terms = {**state_bytes(stage, layout), **act.terms, **process, **checkpoint_copies(stage, layout, step_peak)}
    return Estimate(terms, logits=act.logits, stage=stage.rank)
