"""Peak memory of one training rank, estimated from the model's shapes and the parallel layout.

Terms (bytes), for one pipeline stage:

* **weights**: its parameters in the run's dtype (bf16/fp16: 2 bytes, else 4);
* **gradients**: megatron DDP's gradient buffer, fp32 (``grad_reduce_in_fp32``): 4 bytes/parameter;
* **optimizer**: fp32 main weights when the weights are bf16/fp16 (4), and the state: Adam 8
  (two moments), SGD 4 (momentum), NorMuon 4 (momentum) per matrix parameter plus 4 per output
  row (the per-row second moment), Adam's 8 for the rest; with the distributed optimizer, a share
  (below);
* **activations**: what autograd keeps for backward at the step's peak (below);
* **transients** (on a GPU; on CPU a fitted term of the process, below): what the step's peak adds;
* **logits** are part of the activations of the last stage (fp32 cross-entropy, 4·b·s·V/TP per
  pass held) and listed on their own.

Activations per microbatch and pass (n = b·s/CP tokens, e = activation bytes; TP shards what the
layer computes per head or per FFN unit, and the D-wide tensors only under SP):

    layer = n·(wide + e·(5·F + attention)/tp + fp32) + core
      local spec (CPU; calibrated against ``SavedActivations`` on CPU in FP32 and BF16, tests/test_plan.py;
      torch's norms keep FP32 copies): wide = 4·10·D/sp, attention = 6·h·d + 4·g·d + 2·h (+ 2·h·d
      where GQA's K/V are expanded), fp32 = 4·6
      Transformer Engine spec (counted tensor by tensor from megatron-core 0.16.1 and the model's code,
      docs/planning.md; the tests hold it to an independent count): wide = e·6·D/sp (the two pre-norm
      inputs, the QKV and gate input, fc1's normed input, the two sandwich post-norm inputs),
      attention = 4·h·d + 3·g·d + h (Q and K before the QK norm and after RoPE, V, the core's output,
      the gated output, the gate; + 2·(h − g)·d when the local core expands K/V to every head),
      fp32 = 4·(4/sp + (h + g)/tp) (the norms' and QK norms' rsigma) + flash's log-sum-exp 4·h/tp
      core (megatron's local core: the local spec, and packed SFT rows on a GPU, which need its
      explicit mask): b·h/tp·s²·(4 + e if half) (the FP32 softmax output, the half probabilities)
      + the mask, b·s² bytes for packed rows (each layer ORs its window in), s² otherwise
    first stage + n·e·D (embeddings); fused pass + n·((2·e_n + 4·e)·D/sp + e) (the fusion; e_n: 4
      with the local spec's norms, e with TE's)
    last stage  + n·e_n·(2·D + 3) (final norm) + 4·n·V/tp (FP32 logits in the cross-entropy)

A step of k passes at PP = 1 holds all k passes (k·A + (k−1)·fusion). With ``recompute_passes``
only the passes' inputs stay (e_t, and s^{(j−1)} for j ≥ 2: 2k − 3 tensors of n·D, none when
offloaded) and the last pass is not recomputed (A + fusion). Full recompute keeps each layer's
input (n·D, none when offloaded) and one layer's activations during backward. Under PP the k
passes are virtual chunks of megatron's interleaved schedule: rank r holds up to
2(PP − r − 1) + (k − 1)·PP + 1 chunks (1F1B at k = 1: PP − r microbatches) — an estimate from the
schedule's warmup count, not measured here. ``scores`` says how much of the activations are the
local core's s × s tensors (what a smaller micro batch or sequence, or recompute, shrinks).

**Transients on a GPU** (``transients``): the step's peak is the larger of backward's (the
activations and what backward adds to them) and the optimizer step's (no activations):

* backward: the larger of the cross-entropy's half-precision logits beside their FP32 copy
  (2·n·V/tp on the last stage) and, with the local core, one layer's score gradients (FP32, 8 bytes
  per score: the softmax's incoming and outgoing gradients) plus megatron's persistent score buffer
  (e bytes per score, ``get_global_memory_buffer``);
* the optimizer step: NorMuon's FP32 temporaries (below) or, after them, the layer-wise optimizer's
  all-gather of the updated weights. The project's ``optimizers/layer_wise.py`` pads every DP×CP
  rank's part to the largest (gloo refuses unequal sizes): (DP·CP + 1) × the fullest rank's elements
  in the weights' dtype, where megatron-core's own ``allgather_params`` gathers each part at its size
  (the stage's weights once, plus this rank's part). The padding is priced here, not removed.

The term is what that peak exceeds the activations by. Not counted: activation gradients between
layers, communication buffers beyond NCCL's own (``device.py``), allocator fragmentation.

**Optimizer state** with the distributed optimizer is divided by DP × CP (megatron-core shards over
both); NorMuon's is megatron-core's ``LayerWiseDistributedOptimizer``, which deals whole parameters
out (sorted by size, ping-pong over the DP×CP ranks): the plan counts the fullest rank.

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
  GPU they are host memory. Not counted: at DP > 1 megatron-core's distributed optimizer (Adam, SGD)
  saves ``fully_reshardable``, gathering the whole stage's FP32 main weights and moments onto every DP
  rank and cloning their slices, about 24 bytes a parameter (held-out runs, docs/planning.md).

Checked against runs the CPU terms were not fitted on (docs/planning.md, held-out runs: other widths,
depths, sequences, micro batches, k and optimizers): one process within 18%, planned low where
activations dominate (what backward's allocator holds beyond them is not a term).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List


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
    packed_rows: bool = False  # SFT's packed rows: megatron's local attention core with an explicit mask, even beside TE
    cpu: bool = False  # a process on CPU: its RSS holds the process terms below (module docstring)
    async_save: bool = False

    @property
    def local_core(self) -> bool:
        """Whether attention runs megatron's local (unfused) core, which keeps s × s scores."""
        return self.packed_rows or not self.transformer_engine

    @property
    def layer_wise(self) -> bool:
        """NorMuon under the distributed optimizer: megatron-core's LayerWiseDistributedOptimizer."""
        return self.optimizer == "normuon" and self.distributed_optimizer


RUNTIME = 0.55 * 2**30  # bytes of a CPU process's interpreter and libraries (0.4 GiB) and allocator (module docstring)
RETAINED_PER_LAYER = 1 / 3  # of the FP32 bytes of a layer's matrices, whole: what the allocator keeps per layer on CPU


@dataclass
class Param:
    """One parameter of a stage as a TP rank holds it."""

    numel: int
    rows: int  # the rows of its optimizer state's second moment (NorMuon: the local weight's rows)
    matrix: bool  # NorMuon updates it (``optimizers.uses_normuon``); else Adam/SGD
    newton_schulz: float = 0.0  # FLOPs of its orthogonalisation by the rank that runs it (``planner.stages``)


@dataclass
class Stage:
    """One pipeline stage's parameters (per rank, TP shards) and what it holds besides its layers."""

    rank: int
    layers: int
    params: int
    matrix_params: int  # the 2-D weights NorMuon updates (decoder and fusion matrices; 0 under Adam/SGD)
    matrix_rows: int  # their second moment's rows
    embedding_params: int = 0  # the word embedding's (or the tied output layer's) on this rank
    largest_matrix: int = 0  # the largest of the matrices, whole (NorMuon orthogonalises it gathered)
    first: bool = True
    last: bool = True
    parameters: List[Param] = field(default_factory=list)  # one by one: what the layer-wise optimizer deals out


@dataclass
class Estimate:
    terms: Dict[str, float] = field(default_factory=dict)  # bytes
    logits: float = 0.0  # bytes of the activations that are logits (included in "activations")
    scores: float = 0.0  # bytes of the activations that are the local core's s × s tensors
    stage: int = 0  # the pipeline stage (rank) estimated

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def optimizer_bytes(numel: int, rows: int, matrix: bool, layout: Layout) -> float:
    """Optimizer bytes of ``numel`` parameters whose state has ``rows`` rows (``matrix``: NorMuon's):
    FP32 main weights when the weights are half, and the state (module docstring)."""
    main = 4 * numel if layout.half else 0
    if layout.optimizer == "sgd":
        return main + 4 * numel
    if layout.optimizer == "normuon" and matrix:
        return main + 4 * numel + 4 * rows
    return main + 8 * numel


def layer_wise_parts(stage: Stage, layout: Layout) -> List[List[Param]]:
    """The stage's parameters as megatron-core's LayerWiseDistributedOptimizer deals them to the
    DP×CP ranks (``shard_params``, megatron/core/optimizer/layer_wise_optimizer.py: NorMuon's group,
    then Adam's, sorted by size, dealt ping-pong: 0, 1, …, R−1, R−1, …, 0, 0, 1, …), each part in the order its rank's optimizer
    holds it; one part, in the model's order, at R = 1."""
    ranks = layout.dp * layout.cp
    if ranks == 1:
        return [stage.parameters]  # (megatron-core leaves the groups as they are)
    ordered = sorted([q for q in stage.parameters if q.matrix] + [q for q in stage.parameters if not q.matrix],
                     key=lambda q: q.numel)
    loop = [*range(ranks), *reversed(range(ranks))]
    parts = [[] for _ in range(ranks)]
    for i, q in enumerate(ordered):
        parts[loop[i % len(loop)]].append(q)
    return parts


def state_bytes(stage: Stage, layout: Layout) -> Dict[str, float]:
    """weights, gradients and optimizer bytes of a stage's rank (the fullest layer-wise rank)."""
    p = stage.params
    if layout.layer_wise and stage.parameters:
        optimizer = max(sum(optimizer_bytes(q.numel, q.rows, q.matrix, layout) for q in part)
                        for part in layer_wise_parts(stage, layout))
    else:
        whole = (optimizer_bytes(stage.matrix_params, stage.matrix_rows, True, layout)
                 + optimizer_bytes(p - stage.matrix_params, 0, False, layout))
        optimizer = whole / (layout.dp * layout.cp if layout.distributed_optimizer else 1)
    return {"weights": (2 if layout.half else 4) * p, "gradients": 4 * p, "optimizer": optimizer}


def layer_activations(config, layout: Layout) -> float:
    """Bytes one layer keeps for backward for one microbatch and pass (module docstring)."""
    c, t = config, layout.tp
    sp = t if layout.sequence_parallel else 1
    n, e = layout.micro_batch_size * layout.seq_length / layout.cp, _element_bytes(layout)[0]
    d, h = c.kv_channels, c.num_attention_heads
    g = c.num_query_groups or h
    if layout.transformer_engine:
        wide = e * 6 * c.hidden_size / sp
        attention = 4 * h * d + 3 * g * d + h + (2 * (h - g) * d if layout.local_core else 0)
        fp32 = 4 * (4 / sp + (h + g + (0 if layout.local_core else h)) / t)
    else:
        wide = 4 * 10 * c.hidden_size / sp
        attention = 6 * h * d + 4 * g * d + 2 * h + (2 * h * d if g < h else 0)
        fp32 = 4 * 6
    return n * (wide + e * (5 * c.ffn_hidden_size + attention) / t + fp32) + attention_scores(config, layout)


def score_elements(config, layout: Layout) -> float:
    """Elements of one layer's s × s attention scores on a rank for one microbatch: b·h/tp·s²."""
    s = layout.seq_length / layout.cp
    return layout.micro_batch_size * config.num_attention_heads / layout.tp * s * s


def attention_scores(config, layout: Layout) -> float:
    """Bytes one layer's local attention core keeps for backward (module docstring); 0 with flash."""
    if not layout.local_core:
        return 0.0
    s, e = layout.seq_length / layout.cp, _element_bytes(layout)[0]
    mask = (layout.micro_batch_size if layout.packed_rows else 1) * s * s
    return score_elements(config, layout) * (4 + (e if layout.half else 0)) + mask


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
    chunk_layers = (1 if layer >= edges else 0) if full else stage.layers  # layers' activations a chunk holds
    if layout.pp == 1:
        chunks, held_logits = k, k
    else:
        warmup = 2 * (layout.pp - stage.rank - 1) + (k - 1) * layout.pp if k > 1 else layout.pp - stage.rank - 1
        chunks = min(layout.microbatches * k, warmup + 1)
        held_logits = chunks
    fused = (k - 1) / k * chunks
    if c.recompute_passes and k > 1:
        inputs = (2 * k - 3) * hidden * kept if layout.pp == 1 else (chunks - 1) * hidden * (1 + kept * stage.first)
        total, held_layers = chunk + fusion + inputs, chunk_layers
        held_logits = 1
    elif full:
        # every chunk but the one in backward keeps its edges (logits), layer inputs and fusion
        total, held_layers = (chunks - 1) * (edges + stage.layers * hidden * kept) + fused * fusion + chunk, chunk_layers
    else:
        total, held_layers = chunks * chunk + fused * fusion, chunks * chunk_layers
    return Estimate({"activations": total}, logits=logits * held_logits, scores=held_layers * attention_scores(c, layout))


def layer_matrix_params(config) -> int:
    """A decoder layer's QKV, projection, FC1 and FC2 weights, whole (not TP shards)."""
    c = config
    d, h, g = c.kv_channels, c.num_attention_heads, c.num_query_groups or c.num_attention_heads
    fc1 = (2 if c.gated_linear_unit else 1) * c.ffn_hidden_size
    return c.hidden_size * (h * d + 2 * g * d) + h * d * c.hidden_size + (fc1 + c.ffn_hidden_size) * c.hidden_size


def normuon_temporaries(stage: Stage, layout: Layout) -> float:
    """NorMuon's step: about five FP32 temporaries of its largest matrix, whole (module docstring)."""
    return 5 * 4 * stage.largest_matrix if layout.optimizer == "normuon" else 0.0


def layer_wise_all_gather(stage: Stage, layout: Layout) -> float:
    """Bytes of the project's padded all-gather after a layer-wise step (module docstring): DP·CP
    parts, each as long as the fullest rank's, and this rank's own; 0 without layer-wise ownership."""
    ranks = layout.dp * layout.cp
    if not layout.layer_wise or ranks == 1 or not stage.parameters:
        return 0.0
    fullest = max(sum(q.numel for q in part) for part in layer_wise_parts(stage, layout))
    return (ranks + 1) * fullest * (2 if layout.half else 4)


def transient_bytes(config, layout: Layout, stage: Stage, activations: float) -> Dict[str, float]:
    """``transients``: on a GPU what the step's peak adds to the activations, on CPU the process's
    fitted term (module docstring)."""
    if layout.cpu:
        return {"transients": max(2 * 4 * stage.embedding_params, normuon_temporaries(stage, layout))}
    n, e = layout.micro_batch_size * layout.seq_length / layout.cp, _element_bytes(layout)[0]
    logits = (2 if layout.half else 0) * n * config.vocab_size / layout.tp if stage.last else 0.0
    scores = score_elements(config, layout) * (8 + e) if layout.local_core else 0.0
    step = max(normuon_temporaries(stage, layout), layer_wise_all_gather(stage, layout))
    return {"transients": max(logits, scores, step - activations, 0.0)}


def process_bytes(stage: Stage, layout: Layout, config) -> Dict[str, float]:
    """What a training process on CPU holds besides its tensors (module docstring); none on a GPU."""
    if not layout.cpu:
        return {}
    return {"runtime": RUNTIME + RETAINED_PER_LAYER * 4 * layer_matrix_params(config) * stage.layers}


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
    transients = transient_bytes(config, layout, stage, act.terms["activations"])
    step_peak = act.terms["activations"] + transients["transients"]
    terms = {**state_bytes(stage, layout), **act.terms, **process_bytes(stage, layout, config), **transients,
             **checkpoint_copies(stage, layout, step_peak)}
    return Estimate(terms, logits=act.logits, scores=act.scores, stage=stage.rank)
