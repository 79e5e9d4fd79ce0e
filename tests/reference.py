"""An independent, straightforward implementation of the FBT architecture in plain torch
([batch, seq, hidden] layout, explicit masks and loops), reading the weights of an FBTModel by
name. Tests compare the megatron-core model against it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, base):
    """Rotate-half RoPE on [b, heads, s, d] at positions 0..s−1."""
    b, h, s, d = x.shape
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(s, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [s, d/2]
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def allowed(s, window):
    """[s, s] bool: key j visible from query i (causal, optionally the last `window` tokens)."""
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    ok = j <= i
    if window is not None:
        ok &= j > i - window
    return ok


class Reference:
    def __init__(self, config, state_dict, requires_grad=False):
        self.c = config
        self.w = {
            k: v.detach().clone().requires_grad_(requires_grad)
            for k, v in state_dict.items()
            if torch.is_tensor(v) and v.is_floating_point()
        }

    def p(self, name):
        return self.w[name]

    def attention(self, i, x):
        c, pre = self.c, f"decoder.layers.{i}.self_attention."
        b, s, _ = x.shape
        nq, ng, hd = c.num_attention_heads, c.num_query_groups, c.kv_channels
        per = nq // ng
        qkv = (x @ self.p(pre + "linear_qkv.weight").T).view(b, s, ng, (per + 2) * hd)
        q = qkv[..., : per * hd].reshape(b, s, nq, hd)
        k = qkv[..., per * hd : (per + 1) * hd]
        v = qkv[..., (per + 1) * hd :]
        if c.qk_layernorm:
            q = rms(q, self.p(pre + "q_layernorm.weight"), c.layernorm_epsilon)
            k = rms(k, self.p(pre + "k_layernorm.weight"), c.layernorm_epsilon)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hd]
        q, k = rope(q, c.rotary_base), rope(k, c.rotary_base)
        k = k.repeat_interleave(per, dim=1)
        v = v.repeat_interleave(per, dim=1)
        window = None
        layer_number = i + 1
        if c.sliding_window is not None and not (c.full_attention_every and layer_number % c.full_attention_every == 0):
            window = c.sliding_window
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        scores = scores.masked_fill(~allowed(s, window), float("-inf"))
        o = scores.softmax(-1) @ v  # [b, heads, s, hd]
        if c.headwise_attention_gate:
            gate = torch.sigmoid(x @ self.p(pre + "linear_gate.weight").T)  # [b, s, heads]
            o = o * gate.transpose(1, 2).unsqueeze(-1)
        o = o.transpose(1, 2).reshape(b, s, nq * hd)
        return o @ self.p(pre + "linear_proj.weight").T

    def mlp(self, i, x):
        pre = f"decoder.layers.{i}.mlp."
        gate, up = (x @ self.p(pre + "linear_fc1.weight").T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.p(pre + "linear_fc2.weight").T

    def stack(self, h):
        """Input vectors [b, s, d] → top state s (residual stream after the last layer)."""
        c, eps, a = self.c, self.c.layernorm_epsilon, self.c.depth_scale
        for i in range(c.num_layers):
            pre = f"decoder.layers.{i}."
            out = self.attention(i, rms(h, self.p(pre + "input_layernorm.weight"), eps))
            if c.sandwich_norm:
                out = rms(out, self.p(pre + "post_self_attn_layernorm.weight"), eps)
            h = h + a * out
            out = self.mlp(i, rms(h, self.p(pre + "pre_mlp_layernorm.weight"), eps))
            if c.sandwich_norm:
                out = rms(out, self.p(pre + "post_mlp_layernorm.weight"), eps)
            h = h + a * out
        return h

    def embed(self, tokens):
        return self.p("embedding.word_embeddings.weight")[tokens]

    def head(self, top):
        """Top state → (logits, state fed back)."""
        normed = rms(top, self.p("final_layernorm.weight"), self.c.layernorm_epsilon)
        fed_back = normed if self.c.feedback_state == "final_norm" else top
        return normed @ self.p("embedding.word_embeddings.weight").T, fed_back

    def fuse(self, carried, e):
        """u = RMSNorm(W_U carried ⊙ sigmoid(W_G e)) for one position or many."""
        u = (carried @ self.p("feedback_fusion.linear_state.weight").T) * torch.sigmoid(
            e @ self.p("feedback_fusion.linear_gate.weight").T
        )
        return rms(u, self.p("feedback_fusion.norm.weight"), self.c.layernorm_epsilon)

    def forward(self, tokens):
        return self.head(self.stack(self.embed(tokens)))

    def recurrence(self, tokens, prefix):
        """The decoding-time recurrence, one token at a time (teacher forced): the input at
        1-based position t is e_t for t ≤ max(1, prefix), else fuse(s_{t−1}, e_t), where s_{t−1}
        is the fed-back state the model produced at position t−1. Returns logits [b, s, V]."""
        e = self.embed(tokens)
        b, s, _ = e.shape
        inputs, logits, state = [], [], None
        for t in range(1, s + 1):
            x = e[:, t - 1] if t <= max(1, prefix) else self.fuse(state, e[:, t - 1])
            inputs.append(x)
            lg, fed = self.head(self.stack(torch.stack(inputs, dim=1)))
            logits.append(lg[:, -1])
            state = fed[:, -1]
        return torch.stack(logits, dim=1)

    def multi_pass(self, tokens, labels, loss_mask, feedbacks, detach=False):
        """k passes in parallel; `feedbacks[j]` is the Feedback (seq-first tensors) used by pass
        j+2. Returns (per-pass losses, per-pass state deltas)."""
        e = self.embed(tokens)
        losses, deltas, prev = [], [], None
        for j in range(len(feedbacks) + 1):
            x = e
            if prev is not None:
                fb = feedbacks[j - 1]
                carried = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
                if fb.jitter is not None:
                    carried = carried + fb.jitter.transpose(0, 1)
                x = torch.where(fb.fuse_mask.transpose(0, 1).unsqueeze(-1), self.fuse(carried, e), e)
            logits, fed = self.head(self.stack(x))
            token_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
            m = loss_mask.float()
            losses.append((token_loss * m).sum() / m.sum())
            if prev is not None:
                deltas.append((fed - prev).pow(2).mean().sqrt())
            prev = fed.detach() if detach else fed
        return losses, deltas
