"""The JAX MoELanguageModel (Flax NNX) against the PyTorch one of ``dropless train`` on the same weights:
logits, losses, expert loads and every gradient in fp32, both backends (the kernels under Triton's
interpreter); its training step (the optimizer's schedule, weight-decay mask and a falling loss on
repeated data); shapes and dtypes in bf16; bad configs."""

from __future__ import annotations

import dataclasses
import math

import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax_helpers import assert_matches_torch, torch_oracle  # noqa: E402

from dropless.jax.language_model import MoELanguageModel  # noqa: E402
from dropless.jax.training import decays, lm_loss, lr_schedule, make_optimizer, train_step  # noqa: E402
from dropless.train.loop import lm_loss as torch_lm_loss  # noqa: E402
from dropless.train.model import MoELanguageModel as TorchModel  # noqa: E402
from dropless.train.optim import lr_at, make_optimizer as torch_optimizer  # noqa: E402
from dropless.train.presets import PRESETS, ModelConfig  # noqa: E402

# Smaller than the tiny preset: two layers, so that a jitted forward and backward compiles in seconds.
CONFIGS = {
    "mixtral": ModelConfig(d_model=32, n_layers=2, n_heads=2, num_experts=4, top_k=2, d_ff=24),
    "expert-bias": ModelConfig(d_model=32, n_layers=2, n_heads=4, num_experts=4, top_k=1, d_ff=16,
                               expert_bias=True, z_loss_coef=1e-2),
}
FP32_TOL = 2e-5  # relative Frobenius error against the PyTorch fp32 model
TINY = PRESETS["tiny"]


def _close(got, expected: torch.Tensor, what: str, tol: float = FP32_TOL) -> None:
    assert_matches_torch(got, expected, what, tol)


def _torch_model(config: ModelConfig, seed: int) -> TorchModel:
    torch.manual_seed(seed)
    model = TorchModel(config)
    for moe in model.moe_layers():
        if moe.router.expert_bias is not None:
            moe.router.expert_bias.copy_(0.05 * torch.randn(config.num_experts))
    return model


def _jax_variable(state, torch_name: str):
    """The variable in the JAX model's ``state`` (or its gradients') of a PyTorch parameter name: the same
    path, ``nn.Linear`` and ``nn.Embedding`` weights without the ``.weight``, the router's as ``router_weight``."""
    parts = [int(p) if p.isdigit() else p for p in torch_name.split(".")]
    if parts[-2:] == ["router", "weight"]:
        parts[-2:] = ["router_weight"]
    elif parts[-1] == "weight" and parts[-2] in ("embedding", "lm_head", "qkv", "out", "experts_gate_up",
                                                 "experts_down"):
        parts.pop()
    for part in parts:
        state = state[part]
    return state


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_losses_and_gradients_equal_the_pytorch_model(backend, name):
    config = CONFIGS[name]
    model = _torch_model(config, seed=len(name))
    lm = MoELanguageModel.from_torch(model)
    tokens = torch.randint(0, config.vocab_size, (2, 12))
    targets = torch.randint(0, config.vocab_size, (2, 12))
    with torch_oracle():
        logits = model(tokens)
        loss = torch_lm_loss(logits, targets) + model.aux_loss()
        loss.backward()

    def losses(lm, tokens, targets):
        logits = lm(tokens)
        return lm_loss(logits, targets) + lm.aux_loss(), logits

    fn = nnx.jit(nnx.value_and_grad(losses, has_aux=True))
    (value, logits_jax), grads = fn(lm, jnp.asarray(tokens.numpy()), jnp.asarray(targets.numpy()))
    _close(logits_jax, logits, "logits")
    _close(value, loss, "loss")
    _close(lm.aux_loss(), model.aux_loss(), "aux_loss")
    assert (np.asarray(lm.expert_load()) == model.expert_load().numpy()).all()
    grad_state = nnx.state(grads)
    checked = 0
    for torch_name, p in model.named_parameters():
        _close(_jax_variable(grad_state, torch_name).get_value(), p.grad, f"d {torch_name}")
        checked += 1
    assert checked == len(jax.tree.leaves(nnx.state(lm, nnx.Param)))


def test_from_torch_copies_every_weight_and_the_expert_bias():
    model = _torch_model(CONFIGS["expert-bias"], seed=1)
    lm = MoELanguageModel.from_torch(model)
    params = nnx.state(lm, nnx.Param)
    assert len(jax.tree.leaves(params)) == len(list(model.parameters()))
    for torch_name, p in model.named_parameters():
        assert (np.asarray(_jax_variable(params, torch_name).get_value()) == p.detach().numpy()).all(), torch_name
    for layer, moe in zip(lm.moe_layers(), model.moe_layers()):
        assert (np.asarray(layer.expert_bias.get_value()) == moe.router.expert_bias.numpy()).all()


def test_schedule_and_weight_decay_are_those_of_dropless_train():
    config = dataclasses.replace(TINY.train, steps=50, warmup_steps=7)
    schedule = lr_schedule(config)
    for step in (0, 3, 6, 7, 8, 20, 49, 50, 60):
        assert float(schedule(step)) == pytest.approx(lr_at(step, config), rel=1e-5), step
    model = TorchModel(CONFIGS["mixtral"])
    lm = MoELanguageModel.from_torch(model)
    mask = decays(nnx.state(lm, nnx.Param))
    decayed = sum(leaf.size for leaf, on in zip(jax.tree.leaves(nnx.state(lm, nnx.Param)), jax.tree.leaves(mask))
                  if on)
    groups = torch_optimizer(model, config, torch.device("cpu")).param_groups
    assert decayed == sum(p.numel() for g in groups if g["weight_decay"] > 0 for p in g["params"])
    assert groups[1]["weight_decay"] == 0 and sum(p.numel() for p in groups[1]["params"]) > 0


def test_a_jitted_training_step_lowers_the_loss_on_repeated_data():
    config = dataclasses.replace(TINY.train, batch_size=4, seq_len=32)
    lm = MoELanguageModel(TINY.model, rngs=nnx.Rngs(0))
    optimizer = make_optimizer(lm, config)
    step = nnx.cached_partial(train_step, lm, optimizer)
    windows = jnp.asarray(np.random.default_rng(0).integers(0, 256, (config.batch_size, config.seq_len + 1)))
    results = [step(windows[:, :-1], windows[:, 1:]) for _ in range(8)]
    losses = [float(loss) for loss, _, _ in results]
    assert losses[-1] < losses[0] - 0.3, losses
    _, aux_loss, load = results[-1]
    assert 0 < float(aux_loss) < 1
    assert load.shape == (TINY.model.n_layers, TINY.model.num_experts)
    assert (np.asarray(load).sum(axis=1) == config.batch_size * config.seq_len * TINY.model.top_k).all()
    assert int(optimizer.step.get_value()) == 8


def test_bf16_compute_keeps_fp32_parameters_and_stream():
    config = CONFIGS["mixtral"]
    lm = MoELanguageModel(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    if jax.default_backend() != "gpu":
        assert lm.attention == "xla"  # cuDNN's attention needs a GPU
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (3, 10)))
    logits = nnx.jit(lambda lm, t: lm(t))(lm, tokens)
    assert logits.shape == (3, 10, config.vocab_size) and logits.dtype == jnp.bfloat16
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(lm, nnx.Param))} == {jnp.dtype(jnp.float32)}
    assert lm.aux_loss().dtype == jnp.float32 and np.isfinite(np.asarray(logits, np.float32)).all()
    reference = MoELanguageModel.from_torch(TorchModel(config))
    assert reference.embedding.get_value().dtype == jnp.float32


def test_initial_weights_follow_the_pytorch_scheme():
    lm = MoELanguageModel(TINY.model, rngs=nnx.Rngs(0))
    residual = 0.02 / math.sqrt(2 * TINY.model.n_layers)
    block = lm.blocks[0]
    for value, std in ((lm.embedding, 0.02), (block.attention.qkv, 0.02), (block.attention.out, residual),
                       (block.moe.router_weight, 0.02), (block.moe.experts_gate_up, 0.02),
                       (block.moe.experts_down, residual)):
        assert float(jnp.std(value.get_value())) == pytest.approx(std, rel=0.1)
    assert (np.asarray(block.attention_norm.weight.get_value()) == 1).all()


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="no FP8 recipes"):
        MoELanguageModel(dataclasses.replace(CONFIGS["mixtral"], fp8="rowwise"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention must be one of"):
        MoELanguageModel(CONFIGS["mixtral"], attention="flash", rngs=nnx.Rngs(0))
