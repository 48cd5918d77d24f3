"""MoELanguageModel: the language model of ``dropless train`` as a Flax NNX module, the same model as the
PyTorch ``dropless.train.model.MoELanguageModel``.

    tokens [B, T] -> embedding -> n_layers x (x + attention(rms_norm(x)), x + MoE(rms_norm(x)))
                  -> rms_norm -> lm_head -> logits [B, T, vocab]

Attention is causal multi-head attention with rotary position embeddings through
``jax.nn.dot_product_attention``; the MoE is ``dropless.jax.MoE`` (the grouped GEMMs on the dropless
kernels on a GPU). Mixed precision as the PyTorch run under ``torch.autocast``: parameters and the
residual stream stay fp32, the matmuls, attention and the experts run in ``dtype`` (bf16 for training on
a GPU) with the weights cast at use, norms, rotary and the router in fp32. Parameters use the PyTorch
model's names and ``nn.Linear`` layouts (``[out, in]``), so ``from_torch`` copies them without reshaping.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from dropless.jax.moe import MoE
from dropless.jax.reference import matmul

if TYPE_CHECKING:  # the config is read by its fields: dropless.jax imports nothing from dropless.train
    from dropless.train.presets import ModelConfig

RMS_EPS = 1e-5
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn")


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` fp32 ``[seq_len, head_dim // 2]`` of the rotation angles ``t * theta^(-2i / head_dim)``."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.outer(jnp.arange(seq_len, dtype=jnp.float32), inv_freq)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, H, head_dim]`` (halves as pairs) by the angles of ``cos, sin [T, head_dim // 2]``;
    computed in fp32, returned in x's dtype."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def linear(x: jax.Array, weight: nnx.Param, dtype: Any) -> jax.Array:
    """``x @ weight.T`` in ``dtype`` (x and the ``[out, in]`` weight cast to it, as autocast does); fp32
    in full fp32, as PyTorch multiplies it by default (XLA's default on GPUs rounds to TF32)."""
    return matmul(x.astype(dtype), weight.get_value().astype(dtype).T)


@functools.cache
def cudnn_attention_compiles(head_dim: int, dtype: Any) -> bool:
    """Whether XLA compiles cuDNN's fused causal attention for heads of ``head_dim`` in ``dtype`` on the
    default device (a GPU with a recent enough cuDNN). Compiles one small case, once per argument pair."""
    if jax.default_backend() != "gpu" or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    q = jax.ShapeDtypeStruct((1, 128, 1, head_dim), dtype)
    attend = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
    try:
        jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum())).lower(q, q, q).compile()
    except Exception:  # noqa: BLE001 -- any refusal (no cuDNN, too old, head size) means "use XLA's"
        return False
    return True


def attention_implementation(head_dim: int, dtype: Any) -> str:
    """``"cudnn"`` (fused flash attention) where it compiles for these heads, else ``"xla"`` (XLA's
    attention, which holds the ``[B, H, T, T]`` scores). ``jax.nn.dot_product_attention``'s own default
    (``implementation=None``) is XLA's."""
    return "cudnn" if cudnn_attention_compiles(head_dim, dtype) else "xla"


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype: Any) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, dtype)


class RMSNorm(nnx.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis, in fp32; ``[..., d] -> [..., d]`` in x's dtype."""

    def __init__(self, d: int, *, param_dtype: Any = jnp.float32) -> None:
        self.weight = nnx.Param(jnp.ones(d, param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + RMS_EPS)
        return (normed * self.weight.get_value().astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention with rotary positions: ``x [B, T, d] -> [B, T, d]`` in ``dtype``.

    Parameters: ``qkv [3d, d]`` (query, key, value rows) and ``out [d, d]``.
    """

    def __init__(self, d_model: int, n_heads: int, *, dtype: Any, implementation: str, param_dtype: Any,
                 rngs: nnx.Rngs) -> None:
        self.n_heads, self.dtype, self.implementation = n_heads, dtype, implementation
        self.qkv = nnx.Param(_normal(rngs, (3 * d_model, d_model), 0.02, param_dtype))
        self.out = nnx.Param(_normal(rngs, (d_model, d_model), 0.02, param_dtype))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        B, T, d = x.shape
        qkv = linear(x, self.qkv, self.dtype).reshape(B, T, 3, self.n_heads, d // self.n_heads)
        q, k, v = (qkv[:, :, i] for i in range(3))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # fp32 scores and values multiplied in full fp32, as PyTorch's attention does (XLA's default on
        # GPUs rounds them to TF32); 16-bit ones are unaffected.
        with jax.default_matmul_precision("highest"):
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.implementation)
        return linear(y.reshape(B, T, d), self.out, self.dtype)


class Block(nnx.Module):
    """One decoder layer: ``x + attention(norm(x))``, then ``x + MoE(norm(x))``; ``[B, T, d] -> [B, T, d]``
    in x's dtype (the residual stream's, fp32)."""

    def __init__(self, config: ModelConfig, *, dtype: Any, implementation: str, param_dtype: Any,
                 rngs: nnx.Rngs) -> None:
        self.dtype = dtype
        self.attention_norm = RMSNorm(config.d_model, param_dtype=param_dtype)
        self.attention = Attention(config.d_model, config.n_heads, dtype=dtype, implementation=implementation,
                                   param_dtype=param_dtype, rngs=rngs)
        self.moe_norm = RMSNorm(config.d_model, param_dtype=param_dtype)
        self.moe = MoE(config.d_model, config.d_ff, config.num_experts, config.top_k,
                       aux_loss_coef=config.aux_loss_coef, z_loss_coef=config.z_loss_coef,
                       expert_bias=config.expert_bias, recompute_activation=config.recompute_activation,
                       param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        # The experts compute in the input's dtype; the router casts it back to fp32 (so it sees the
        # normed stream rounded to ``dtype``, where PyTorch's autocast router sees it in fp32).
        return x + self.moe(self.moe_norm(x).astype(self.dtype))


class MoELanguageModel(nnx.Module):
    """A byte-level decoder-only MoE language model: ``tokens int [B, T] -> logits [B, T, vocab]`` in ``dtype``.

    Args:
        config: the model's settings (a ``dropless.train.presets.ModelConfig``; its ``fp8`` must be None:
            ``dropless.jax.MoE`` has no FP8 recipes).
        dtype: what the matmuls, attention and experts compute in (``jnp.bfloat16`` for training on a GPU,
            as ``dropless train`` under autocast; ``jnp.float32`` to compare values).
        attention: ``jax.nn.dot_product_attention``'s implementation, ``"xla"`` or ``"cudnn"``; None picks
            cuDNN's fused attention where it compiles (a GPU, 16-bit ``dtype``), XLA's elsewhere.
        param_dtype: the parameters' dtype; rngs: ``nnx.Rngs`` for the initial weights (GPT-2's scheme,
            as the PyTorch model: N(0, 0.02), the projections into the residual stream scaled down by
            ``sqrt(2 * n_layers)``, norms at one).

    Parameters (``nnx.Param``, the PyTorch model's names): ``embedding [V, d]``, ``blocks[i].attention_norm
    .weight``, ``blocks[i].attention.qkv [3d, d]`` and ``.out [d, d]``, ``blocks[i].moe_norm.weight``,
    ``blocks[i].moe`` (``dropless.jax.MoE``'s), ``norm.weight [d]``, ``lm_head [V, d]``.

    After a call, ``aux_loss()`` is the sum of the layers' router losses (weighted by the config's
    coefficients) and ``expert_load()`` the token copies each layer sent to each expert.
    """

    def __init__(self, config: ModelConfig, *, dtype: Any = jnp.float32, attention: str | None = None,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        if config.fp8 is not None:
            raise ValueError(f"dropless.jax.MoE has no FP8 recipes; the config asks for fp8={config.fp8!r}")
        if attention is None:
            attention = attention_implementation(config.head_dim, dtype)
        if attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS} or None, got {attention!r}")
        self.config, self.dtype, self.attention = config, dtype, attention
        d, V = config.d_model, config.vocab_size
        self.embedding = nnx.Param(_normal(rngs, (V, d), 0.02, param_dtype))
        self.blocks = nnx.List([Block(config, dtype=dtype, implementation=attention, param_dtype=param_dtype,
                                      rngs=rngs) for _ in range(config.n_layers)])
        self.norm = RMSNorm(d, param_dtype=param_dtype)
        self.lm_head = nnx.Param(_normal(rngs, (V, d), 0.02, param_dtype))
        residual_std = 0.02 / math.sqrt(2 * config.n_layers)
        for block in self.blocks:
            block.attention.out.set_value(_normal(rngs, (d, d), residual_std, param_dtype))
            moe = block.moe  # dropless.jax.MoE draws uniform weights; the model's scheme replaces them
            for variable, std in ((moe.router_weight, 0.02), (moe.experts_gate_up, 0.02),
                                  (moe.experts_down, residual_std)):
                variable.set_value(_normal(rngs, variable.get_value().shape, std, param_dtype))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """``tokens`` int ``[B, T]`` -> logits ``[B, T, vocab_size]`` in ``dtype``."""
        cos, sin = rotary_tables(tokens.shape[1], self.config.head_dim, self.config.rope_theta)
        x = self.embedding.get_value()[tokens]
        for block in self.blocks:
            x = block(x, cos, sin)
        return linear(self.norm(x), self.lm_head, self.dtype)

    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.blocks]

    def aux_loss(self) -> jax.Array:
        """fp32 scalar: the weighted load-balancing and z losses of the last call, summed over layers."""
        return jnp.stack([moe.aux_loss.get_value() for moe in self.moe_layers()]).sum()

    def expert_load(self) -> jax.Array:
        """int32 ``[n_layers, num_experts]``: token copies routed to each expert in the last call."""
        return jnp.stack([moe.tokens_per_expert.get_value() for moe in self.moe_layers()])

    def update_expert_bias(self) -> None:
        """Move every router's expert bias toward balance (``expert_bias`` models; once per optimizer step)."""
        for moe in self.moe_layers():
            moe.update_expert_bias()

    @classmethod
    def from_torch(cls, model: Any, *, dtype: Any = jnp.float32, attention: str | None = None,
                   param_dtype: Any = None) -> MoELanguageModel:
        """The model with a PyTorch ``MoELanguageModel``'s config and every one of its weights (the routers'
        expert-bias state too); ``param_dtype`` defaults to the PyTorch weights' dtype."""
        from dropless.jax.convert import language_model_from_torch

        return language_model_from_torch(cls, model, dtype, attention, param_dtype)
