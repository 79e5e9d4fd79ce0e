"""The vLLM model of an FBT export (``FBTForCausalLM``, the architecture of the export's config.json).

Layers as ``convert/hf/modeling_fbt.py`` defines them, built from vLLM's (tensor-parallel linear
layers, per-layer sliding-window attention, neox RoPE, RMSNorm): q/k RMSNorm over head_dim before
RoPE, the headwise sigmoid gate on each head's output, sandwich norms with the residual scale α, a
SwiGLU MLP, the final norm and the tied embedding. The residual stream is carried as vLLM's models
carry it (each norm adds the previous branch's output first: vLLM's fused add + RMSNorm), with α
folded into the weights of each branch's last step once loaded (``fold_residual_scale``). The FBT fusion

    u_t = RMSNorm(W_U s_{t-1} ⊙ sigmoid(W_G e_t))

takes W_U s_{t-1} from the state's ``values``, which the state fills before each pass from the
persistent state buffer or from the previous pass of the same step, as the step's plan says (``state``).

A pass is ``FBTModel.forward``, compiled by vLLM (``support_torch_compile``; its default on CPU, off
with ``enforce_eager``): the same tensor program for every step, whatever its requests are. Every
token's input is ``where(reads, fuse(values[source], e_t), e_t)`` and every token's top state is written to
its slot (scratch for all but a soft/fused request's last token), through the state's index tensors
at fixed addresses, with nothing data-dependent in Python: what CUDA graphs can capture per batch
size. Standard tokens pay for a fusion they discard (a gate lookup, a product and a norm each; no
GEMM: W_U is applied outside the pass, to the states read). A step's plan says how many passes it
runs (``FBTForCausalLM.forward``, outside the graph): one in decode steps and plain prefills; n + 1
for a fused(n) prompt, more for chained decoded positions, each pass after the first preceded by the
carry of the previous pass's top states (``FeedbackState.carry``: W_U over the carried tokens and an
index copy). With CUDA graphs, ``gather`` and ``carry`` run outside the captured pass.
vLLM's profile, dummy and warm-up runs (which compile the pass) find the index tensors neutral, so
they read and write scratch only.

Norms are vLLM's ``RMSNorm`` (``FBTRMSNorm``): compiled, its native form, fused by inductor with its
neighbours; in eager steps on CPU they call vLLM's CPU kernels (``torch.ops._C.rms_norm``,
``fused_add_rms_norm``), one call each where vLLM's ``RMSNorm`` runs its native form (about ten ops:
its kernel choice lists those kernels for GPUs only); on GPUs, vLLM's own choice.

Weights load from the export's safetensors names. Three different weights are called ``gate_proj``:
``self_attn.gate_proj`` (the headwise gate, appended to ``qkv_proj`` once loaded: one GEMM per layer),
``mlp.gate_proj`` (SwiGLU's gate, stacked with ``up_proj`` into ``gate_up_proj``) and
``feedback.gate_proj`` (W_G).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                               ReplicatedLinear, RowParallelLinear)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.sequence import IntermediateTensors

from fbt_megatron.inference.serving.state import FeedbackState


class FBTRMSNorm(RMSNorm):
    """vLLM's RMSNorm (``norm(x)``, or ``norm(x, residual)`` → (RMSNorm(x + residual), x + residual)),
    with vLLM's CPU kernels in eager steps (the module docstring); a strided input (a q/k head split)
    is copied to rows first, and a width the kernels' vectors do not divide takes the native form."""

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.shape[-1] % 16:
            return self.forward_native(x, residual)
        if residual is None:
            rows = x.reshape(-1, x.shape[-1]).contiguous()  # the kernel reads whole rows
            out = torch.empty_like(rows)
            torch.ops._C.rms_norm(out, rows, self.weight.data, self.variance_epsilon)
            return out.view(x.shape)
        if not (x.is_contiguous() and residual.is_contiguous()):
            return self.forward_native(x, residual)
        torch.ops._C.fused_add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)  # in place
        return x, residual


class FBTAttention(nn.Module):
    def __init__(self, config, layer_idx: int, cache_config, quant_config, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        d = config.hidden_size
        self.qkv_proj = QKVParallelLinear(d, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
                                          bias=False, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, d, bias=False,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.q_norm = FBTRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = FBTRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        # the headwise gate: one row per query head, split across ranks with the heads; loaded on its own,
        # then folded into qkv_proj (``fold_gate``)
        self.gate_proj = (ColumnParallelLinear(d, config.num_attention_heads, bias=False, quant_config=None,
                                               prefix=f"{prefix}.gate_proj") if config.attention_gate else None)
        self.gate_size = 0  # the gate's columns at the end of qkv_proj's output, once folded
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings, is_neox_style=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)})
        windowed = config.layer_types[layer_idx] == "sliding_attention"
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                              cache_config=cache_config, quant_config=quant_config,
                              per_layer_sliding_window=config.sliding_window if windowed else None,
                              prefix=f"{prefix}.attn")

    def fold_gate(self) -> None:
        """After loading: the headwise gate's rows (this rank's heads) appended to qkv_proj's, so one
        GEMM per layer gives q, k, v and the gate (vLLM prepares its kernel from the weight after
        loading). The same dot products: the gate's values equal a separate projection's up to the
        GEMM's summation order."""
        if self.gate_proj is None:
            return
        qkv = self.qkv_proj.weight
        self.qkv_proj.weight = nn.Parameter(torch.cat([qkv.data, self.gate_proj.weight.data]), requires_grad=False)
        self.gate_size, self.gate_proj = self.gate_proj.weight.shape[0], None

    def _norm_heads(self, x: torch.Tensor, norm: FBTRMSNorm) -> torch.Tensor:
        return norm(x.view(*x.shape[:-1], -1, self.head_dim)).view(x.shape)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkvg, _ = self.qkv_proj(x)
        q, k, v, gate = qkvg.split([self.q_size, self.kv_size, self.kv_size, self.gate_size], dim=-1)
        if self.q_norm is not None:
            q, k = self._norm_heads(q, self.q_norm), self._norm_heads(k, self.k_norm)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v)
        if self.gate_size:
            out = (out.view(-1, self.num_heads, self.head_dim) * torch.sigmoid(gate).unsqueeze(-1)).view(out.shape)
        out, _ = self.o_proj(out)
        return out


class FBTMLP(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gate_up))
        return out


class FBTDecoderLayer(nn.Module):
    """h ← h + α·post_attention_layernorm(Attn(input_layernorm(h)));
    h ← h + α·post_feedforward_layernorm(MLP(pre_feedforward_layernorm(h))),
    carried as (the last branch's output, the stream before it), α in the branches' weights."""

    def __init__(self, config, layer_idx: int, cache_config, quant_config, prefix: str):
        super().__init__()
        eps, d = config.rms_norm_eps, config.hidden_size
        self.alpha = float(config.residual_scale)
        self.input_layernorm = FBTRMSNorm(d, eps=eps)
        self.self_attn = FBTAttention(config, layer_idx, cache_config, quant_config, f"{prefix}.self_attn")
        self.pre_feedforward_layernorm = FBTRMSNorm(d, eps=eps)
        self.mlp = FBTMLP(config, quant_config, f"{prefix}.mlp")
        self.post_attention_layernorm = FBTRMSNorm(d, eps=eps) if config.sandwich_norm else None
        self.post_feedforward_layernorm = FBTRMSNorm(d, eps=eps) if config.sandwich_norm else None

    def fold_residual_scale(self) -> None:
        """After loading: α into the last weights of each branch (the sandwich norms' gains, or
        o_proj and down_proj without them), so the stream adds the branch's output as it is: the
        same values up to rounding (α·(g·x) becomes (α·g)·x)."""
        last = ((self.post_attention_layernorm, self.post_feedforward_layernorm)
                if self.post_attention_layernorm is not None else (self.self_attn.o_proj, self.mlp.down_proj))
        for module in last:
            module.weight.data.mul_(self.alpha)

    def forward(self, positions: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None):
        """(the previous layer's last branch output, the stream before it; for the first layer the
        input and None) → this layer's."""
        if residual is None:
            x, residual = self.input_layernorm(out), out
        else:
            x, residual = self.input_layernorm(out, residual)
        out = self.self_attn(positions, x)
        if self.post_attention_layernorm is not None:
            out = self.post_attention_layernorm(out)
        x, residual = self.pre_feedforward_layernorm(out, residual)
        out = self.mlp(x)
        if self.post_feedforward_layernorm is not None:
            out = self.post_feedforward_layernorm(out)
        return out, residual


class FBTFeedbackFusion(nn.Module):
    """u = norm(up_proj(s) ⊙ sigmoid(gate_proj(e))), up_proj = W_U, gate_proj = W_G (replicated).

    W_U s is taken where the state is taken, outside the compiled pass (``project``, called by the
    state's ``gather`` and ``carry``), for the states read only: a pass multiplies nothing by W_U,
    and a step of standard requests takes no product at all. sigmoid(W_G e_t)
    depends on the token alone: once loaded, ``gates`` holds it for every token of the vocabulary
    (``tabulate``; split over tensor-parallel ranks as the embedding is, V×D more memory), so a pass
    looks the token's gate up (on GPUs, W_G is not read every decode step). Prompt embeddings given
    without tokens take the product."""

    def __init__(self, config, prefix: str):
        super().__init__()
        d = config.hidden_size
        self.up_proj = ReplicatedLinear(d, d, bias=False, prefix=f"{prefix}.up_proj")
        self.gate_proj = ReplicatedLinear(d, d, bias=False, prefix=f"{prefix}.gate_proj")
        self.norm = FBTRMSNorm(d, eps=config.rms_norm_eps)
        self.gates = VocabParallelEmbedding(config.vocab_size, d, prefix=f"{prefix}.gates")

    @torch.no_grad()
    def tabulate(self, embedding: VocabParallelEmbedding) -> None:
        """After loading (before vLLM prepares the linear layers' kernels): every token's sigmoid(W_G e),
        this rank's rows of the embedding."""
        self.gates.weight.copy_(torch.sigmoid(nn.functional.linear(embedding.weight, self.gate_proj.weight)))

    def project(self, states: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """W_U s for the states a step's tokens read (into ``out`` when given)."""
        projected = self.up_proj(states)[0]
        return projected if out is None else out.copy_(projected)

    def forward(self, projected: torch.Tensor, input_ids: torch.Tensor | None, embeddings: torch.Tensor) -> torch.Tensor:
        """projected: W_U s_{t-1} (``project``); embeddings: e_t."""
        gate = self.gates(input_ids) if input_ids is not None else torch.sigmoid(self.gate_proj(embeddings)[0])
        return self.norm(projected * gate)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0,
                                         "inputs_embeds": 0})
class FBTModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config, quant_config = vllm_config.cache_config, vllm_config.quant_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            FBTDecoderLayer(config, i, cache_config, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = FBTRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.feedback = self.feedback_state = None
        if config.latent_feedback:
            scheduler = vllm_config.scheduler_config
            self.feedback = FBTFeedbackFusion(config, f"{prefix}.feedback")
            self.feedback_state = FeedbackState(
                scheduler.max_num_seqs, scheduler.max_num_batched_tokens, config.hidden_size,
                vllm_config.model_config.dtype, torch.device(vllm_config.device_config.device))

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None):
        """One pass over the step's tokens (the module docstring): RMSNorm_final(h_L), and for FBT
        also the top states (after writing them to their slots)."""
        e = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        state = self.feedback_state
        if state is None:  # a baseline export
            return self.stack(positions, e)[1]
        n = e.shape[0]
        values = state.values.index_select(0, state.token_source[:n])
        x = torch.where(state.token_reads[:n], self.feedback(values, input_ids, e), e)
        hidden, normed = self.stack(positions, x)
        top = self.top_state(hidden, normed)
        state.write(top)
        return normed, top

    def stack(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass: inputs → (h_L, RMSNorm_final(h_L))."""
        out, residual = x, None
        for layer in self.layers:
            out, residual = layer(positions, out, residual)
        normed, hidden = self.norm(out, residual)
        return hidden, normed

    def top_state(self, hidden: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return normed if self.config.feedback_source == "final_norm" else hidden


class FBTForCausalLM(nn.Module):
    """vLLM's model interface (``interfaces_base``) for FBT exports; see the module docstring."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = FBTModel(vllm_config=vllm_config, prefix="model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.feedback_state = self.model.feedback_state

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        state = self.feedback_state
        if state is None:
            return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        plan = state.plan  # None in profile / dummy runs: one pass, the index tensors neutral
        if plan is None:
            state.neutral()
        project = self.model.feedback.project
        state.gather(project)
        for j in range(1, (plan.passes if plan is not None else 1) + 1):
            if j > 1:
                state.carry(top, plan, j, project)
            normed, top = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        return normed

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The export's safetensors names → this model's parameters (q/k/v stacked into qkv_proj,
        SwiGLU's gate/up into gate_up_proj; the headwise gate and W_G keep their names)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, weight in weights:
            if name == "lm_head.weight":  # tied: the embedding
                continue
            target, shard = name, None
            for part in ("q", "k", "v"):
                if f".self_attn.{part}_proj." in name:
                    target, shard = name.replace(f".{part}_proj.", ".qkv_proj."), part
            for index, part in enumerate(("gate", "up")):
                if f".mlp.{part}_proj." in name:
                    target, shard = name.replace(f".mlp.{part}_proj.", ".mlp.gate_up_proj."), index
            if target not in params:
                raise ValueError(f"unexpected weight {name} in the export (no parameter {target})")
            param = params[target]
            if shard is None:
                getattr(param, "weight_loader", default_weight_loader)(param, weight)
            else:
                param.weight_loader(param, weight, shard)
            loaded.add(target)
        for layer in self.model.layers:
            layer.self_attn.fold_gate()
            layer.fold_residual_scale()
        if self.model.feedback is not None:
            self.model.feedback.tabulate(self.model.embed_tokens)
            loaded.add("model.feedback.gates.weight")  # made from the loaded weights
        return loaded
