"""The language model of ``dropless train``: a Mixtral-style decoder with a dropless MoE as every FFN.

    tokens [B, T] -> embedding -> n_layers x (x + attention(rms_norm(x)), x + MoE(rms_norm(x)))
                  -> rms_norm -> lm_head -> logits [B, T, vocab]

Attention is causal multi-head attention with rotary position embeddings through
``F.scaled_dot_product_attention`` (flash attention on a GPU). The residual stream stays fp32; under
autocast the matmuls run in its dtype (bf16 on a GPU), the MoE's grouped GEMMs included, while the
MoE's router computes in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dropless.nn.moe import MoE
from dropless.train.presets import ModelConfig


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` fp32 ``[seq_len, head_dim // 2]`` of the rotation angles ``t * theta^(-2i / head_dim)``."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, H, head_dim]`` (halves as pairs) by the angles of ``cos, sin [T, head_dim // 2]``;
    computed in fp32, returned in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions: ``x [B, T, d] -> [B, T, d]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, d // self.n_heads).unbind(2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    """One decoder layer: ``x + attention(norm(x))``, then ``x + MoE(norm(x))``; ``[B, T, d] -> [B, T, d]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.d_model, eps=1e-5)
        self.attention = Attention(config)
        self.moe_norm = nn.RMSNorm(config.d_model, eps=1e-5)
        self.moe = MoE(config.d_model, config.d_ff, config.num_experts, config.top_k,
                       aux_loss_coef=config.aux_loss_coef, z_loss_coef=config.z_loss_coef,
                       expert_bias=config.expert_bias, recompute_activation=config.recompute_activation,
                       recipe=config.fp8)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.moe(self.moe_norm(x))


class MoELanguageModel(nn.Module):
    """A byte-level decoder-only MoE language model: ``tokens int64 [B, T] -> logits [B, T, vocab]``.

    After a forward, ``aux_loss()`` is the sum of the layers' router losses (already weighted by the
    config's coefficients) and ``expert_load()`` the token copies each layer sent to each expert.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=1e-5)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """GPT-2's scheme: N(0, 0.02) weights, the projections into the residual stream scaled down by
        ``sqrt(2 * n_layers)`` so that the stream's variance does not grow with depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            into_residual = name.endswith(("attention.out.weight", "experts_down.weight"))
            nn.init.normal_(p, std=residual_std if into_residual else 0.02)

    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.blocks]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` int64 ``[B, T]`` -> logits ``[B, T, vocab_size]`` (the autocast dtype under autocast,
        else fp32)."""
        cos, sin = rotary_tables(tokens.shape[1], self.config.head_dim, self.config.rope_theta, tokens.device)
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))

    def aux_loss(self) -> torch.Tensor:
        """fp32 scalar: the weighted load-balancing and z losses of the last forward, summed over layers."""
        return torch.stack([moe.aux_loss for moe in self.moe_layers()]).sum()

    def expert_load(self) -> torch.Tensor:
        """int64 ``[n_layers, num_experts]``: token copies routed to each expert in the last forward (on the device)."""
        return torch.stack([moe.tokens_per_expert for moe in self.moe_layers()]).long()

    def update_expert_bias(self) -> None:
        """Move every router's expert bias toward balance (``expert_bias`` models; once per optimizer step)."""
        for moe in self.moe_layers():
            moe.update_expert_bias()


def parameter_counts(config: ModelConfig) -> tuple[int, int, int]:
    """``(total, active, embedding)`` parameter counts of the model of ``config``, without building it.

    ``active`` is what one token's forward multiplies by: all but the embedding table (a lookup) and
    the ``num_experts - top_k`` experts it does not go to.
    """
    d, E, V = config.d_model, config.num_experts, config.vocab_size
    expert = 3 * d * config.d_ff
    attention = 4 * d * d
    per_layer = attention + E * d + E * expert + 2 * d
    embedding = V * d
    total = embedding + config.n_layers * per_layer + d + V * d
    active = total - embedding - config.n_layers * (E - config.top_k) * expert
    return total, active, embedding
