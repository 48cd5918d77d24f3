"""Training the JAX ``MoELanguageModel`` as ``dropless train`` trains the PyTorch one: the same loss, AdamW
with the same settings and schedule, one jitted step.

Each step (``train_step``, one ``nnx.jit`` computation, no host sync): the forward in the model's compute
dtype, next-byte cross-entropy plus the routers' auxiliary losses, their gradients, clipping by the global
gradient norm, AdamW at the scheduled learning rate (weight decay on matrices and expert weights, none on
norms, as ``dropless.train.optim``), and the expert-bias update for bias-balanced models.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dropless.jax.language_model import MoELanguageModel

if TYPE_CHECKING:  # read by its fields: dropless.jax imports nothing from dropless.train
    from dropless.train.presets import TrainConfig


def lr_schedule(config: TrainConfig) -> optax.Schedule:
    """The learning rate of optimizer step ``count`` (0-based), ``dropless.train.optim.lr_at``'s: linear
    warm-up over ``warmup_steps`` to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at ``steps``."""
    lr, warmup = config.lr, config.warmup_steps
    floor = config.min_lr_ratio * lr
    decay_steps = max(1, config.steps - warmup)

    def schedule(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count, jnp.float32)
        progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        cosine = floor + 0.5 * (lr - floor) * (1 + jnp.cos(math.pi * progress))
        return jnp.where(step < warmup, lr * (step + 1) / max(1, warmup), cosine)

    return schedule


def decays(params: Any) -> Any:
    """The weight-decay mask of ``params``: True for matrices and expert weights (2+ dims), False for norms."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(model: MoELanguageModel, config: TrainConfig) -> nnx.Optimizer:
    """AdamW over the model's ``nnx.Param``s after clipping the gradients' global norm to ``grad_clip``:
    ``dropless.train.optim.make_optimizer``'s settings (betas, eps 1e-8, decoupled weight decay on 2+-dim
    parameters) at ``lr_schedule(config)``."""
    tx = optax.chain(optax.clip_by_global_norm(config.grad_clip),
                     optax.adamw(lr_schedule(config), b1=config.beta1, b2=config.beta2, eps=1e-8,
                                 weight_decay=config.weight_decay, mask=decays))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (fp32 scalar) of ``logits [B, T, V]`` against ``targets`` int ``[B, T]``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def _losses(model: MoELanguageModel, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    loss = lm_loss(model(inputs), targets)
    aux_loss = model.aux_loss()
    return loss + aux_loss, (loss, aux_loss)


@nnx.jit(donate_argnums=(0, 1))
def train_step(model: MoELanguageModel, optimizer: nnx.Optimizer, inputs: jax.Array,
               targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One optimizer step on ``inputs, targets`` int ``[B, T]``, updating ``model`` and ``optimizer`` in
    place (their buffers are donated); returns the LM loss and auxiliary loss (fp32 scalars) and the
    expert load (int32 ``[n_layers, E]``), on the device. No host sync.

    For a loop, ``nnx.cached_partial(train_step, model, optimizer)`` takes ``(inputs, targets)`` and
    skips re-reading the module graph at every call."""
    grads, (loss, aux_loss) = nnx.grad(_losses, has_aux=True)(model, inputs, targets)
    optimizer.update(model, grads)
    if model.config.expert_bias:
        model.update_expert_bias()
    return loss, aux_loss, model.expert_load()
