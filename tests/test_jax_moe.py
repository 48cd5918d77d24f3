"""dropless.jax.MoE (Flax NNX) against dropless.MoE (PyTorch) on the same weights: outputs, losses, the
gradients of every parameter and of the input, the expert bias state, weight conversion both ways,
jit/grad composition, and bad input. Both backends (the kernels under Triton's interpreter)."""

from __future__ import annotations

import re

import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp  # noqa: E402
from jax.ad_checkpoint import print_saved_residuals  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from jax_helpers import assert_matches_torch, torch_oracle  # noqa: E402

import dropless  # noqa: E402
from dropless import jax as djax  # noqa: E402

OPTIONS = {
    "mixtral": dict(),
    "deepseek": dict(score_func="sigmoid", n_groups=4, topk_groups=2, expert_bias=True, routed_scaling=2.5,
                     num_shared_experts=1, shared_d_ff=8, z_loss_coef=1e-3),
    "bias-geglu": dict(bias=True, activation="geglu", renormalize=False, aux_loss_coef=0.1),
}
# name -> (d_model, d_ff, E, k, tokens)
SHAPES = {"mixtral": (16, 12, 8, 2, (3, 7)), "deepseek": (16, 12, 8, 3, (13,)), "bias-geglu": (8, 12, 4, 1, (9,)),
          "top8-of-8": (8, 4, 8, 8, (5,)), "one-expert": (8, 4, 1, 1, (6,)), "one-token": (8, 4, 4, 2, (1,))}


def _layers(name: str, seed: int):
    d, f, E, k, tokens = SHAPES[name]
    torch.manual_seed(seed)
    moe = dropless.MoE(d, f, E, k, **OPTIONS.get(name, {}))
    if moe.router.expert_bias is not None:
        moe.router.expert_bias.copy_(0.05 * torch.randn(E))
    return moe, djax.MoE.from_torch(moe), torch.randn(*tokens, d), torch.randn(*tokens, d)


def _jax(t: torch.Tensor) -> jax.Array:
    return jnp.asarray(t.detach().numpy())


def _close(got, expected: torch.Tensor, what: str, tol: float = 2e-5) -> None:
    assert_matches_torch(got, expected, what, tol)


@pytest.mark.parametrize("name", list(SHAPES))
def test_outputs_losses_and_gradients_equal_the_pytorch_layer(backend, name):
    moe, layer, x, g = _layers(name, seed=len(name))
    with torch_oracle():
        y = moe(x.requires_grad_())
        (y * g).sum().add(moe.aux_loss).backward()

    def loss(layer, x):
        y = layer(x)
        return (y * _jax(g)).sum() + layer.aux_loss.get_value(), y

    grad_fn = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (value, y_jax), (grads, dx) = grad_fn(layer, _jax(x))
    _close(y_jax, y, "y")
    _close(layer.aux_loss.get_value(), moe.aux_loss, "aux_loss")
    _close(layer.z_loss.get_value(), moe.z_loss, "z_loss")
    assert (np.asarray(layer.tokens_per_expert.get_value()) == moe.tokens_per_expert.numpy()).all()
    _close(dx, x.grad, "dx")
    params = dict(moe.named_parameters())
    pairs = {"router_weight": "router.weight", "experts_gate_up": "experts_gate_up.weight",
             "experts_down": "experts_down.weight", "experts_gate_up_bias": "experts_gate_up.bias",
             "experts_down_bias": "experts_down.bias", "shared_gate_up": "shared_experts.gate_up.weight",
             "shared_down": "shared_experts.down.weight"}
    checked = 0
    for jax_name, torch_name in pairs.items():
        if torch_name in params:
            _close(getattr(grads, jax_name).get_value(), params[torch_name].grad, f"d{jax_name}")
            checked += 1
    assert checked == len(params)


def test_recompute_activation_saves_no_activation_and_runs_no_extra_product(backend, capsys):
    """The same gradients; the backward's saved values hold no [T*k, d_ff] activation; and on the kernels
    the compiled step runs as many grouped GEMMs as without recomputation (the down product's forward is
    not run again: 5, the input taking no gradient)."""
    d, f, E, k = 8, 12, 4, 2
    torch.manual_seed(5)
    moe = dropless.MoE(d, f, E, k)
    x = _jax(torch.randn(10, d))
    grads, kernel_calls = {}, {}
    for recompute in (False, True):
        moe.options["recompute_activation"] = recompute
        layer = djax.MoE.from_torch(moe)
        assert layer.options["recompute_activation"] is recompute

        def loss(layer, x):
            return (layer(x) ** 2).sum()

        grads[recompute] = nnx.grad(loss)(layer, x)
        graphdef, state = nnx.split(layer)
        print_saved_residuals(lambda state, x: loss(nnx.merge(graphdef, state), x), state, x)
        saved = capsys.readouterr().out
        activation = f"f32[{10 * k},{f}]"
        assert (activation in saved) != recompute, saved
        if backend[0] == "triton":
            hlo = jax.jit(nnx.grad(loss)).lower(layer, x).compile().as_text()
            kernel_calls[recompute] = len(re.findall(r"xla_buffer_python_[a-z]+_callback", hlo))
    assert kernel_calls.get(True) == kernel_calls.get(False) in (None, 5)
    for name in ("experts_gate_up", "experts_down", "router_weight"):
        np.testing.assert_allclose(getattr(grads[True], name).get_value(), getattr(grads[False], name).get_value(),
                                   rtol=1e-6, atol=1e-7)


def test_weights_move_both_ways_exactly():
    moe, layer, _, _ = _layers("deepseek", seed=1)
    back = layer.to_torch()
    for (name, a), b in zip(moe.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b.to(a.dtype)), name
    assert back.options == moe.options
    with torch.no_grad():
        moe.router.weight.add_(1.0)
    assert torch.equal(layer.to_torch().router.weight, back.router.weight), "the JAX copy follows the PyTorch tensor"


def test_bf16_weights_convert_and_run(backend):
    moe, _, x, _ = _layers("mixtral", seed=2)
    moe = moe.to(torch.bfloat16)
    layer = djax.MoE.from_torch(moe)
    assert layer.experts_gate_up.get_value().dtype == jnp.bfloat16
    y = layer(_jax(x).astype(jnp.bfloat16))
    with torch_oracle():
        expected = moe(x.bfloat16()).float()
    _close(y.astype(jnp.float32), expected, "y (bf16)", tol=2e-2)


def test_expert_bias_moves_as_in_pytorch_and_eval_does_not_count(reference_backend):
    moe, layer, x, _ = _layers("deepseek", seed=3)
    for _ in range(2):
        moe(x)
        layer(_jax(x))
    moe.update_expert_bias()
    layer.update_expert_bias()
    _close(layer.expert_bias.get_value(), moe.router.expert_bias, "expert_bias", tol=1e-7)
    layer.eval()
    layer(_jax(x))
    assert (np.asarray(layer.load_since_update.get_value()) == 0).all()


def test_a_jitted_training_step_lowers_the_loss(backend):
    import optax

    _, layer, x, _ = _layers("mixtral", seed=4)
    target = jnp.asarray(np.random.default_rng(0).standard_normal(x.shape), jnp.float32)
    optimizer = nnx.Optimizer(layer, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(layer, optimizer, x):
        def loss(layer):
            return jnp.mean((layer(x) - target) ** 2) + layer.aux_loss.get_value()
        value, grads = nnx.value_and_grad(loss)(layer)
        optimizer.update(layer, grads)
        return value

    losses = [float(step(layer, optimizer, _jax(x))) for _ in range(5)]
    assert losses[-1] < losses[0], losses


BAD = [
    ("top_k=0", dict(top_k=0), "top_k must be in"),
    ("top_k>E", dict(top_k=9), "top_k must be in"),
    ("n_groups", dict(n_groups=3, topk_groups=1), "n_groups=3 must divide"),
    ("topk_groups", dict(n_groups=4, topk_groups=5), "topk_groups must be in"),
    ("activation", dict(activation="relu"), "activation must be one of"),
    ("score_func", dict(score_func="tanh"), "score_func must be one of"),
]


@pytest.mark.parametrize("name, change, pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_options_raise_at_construction(name, change, pattern):
    options = dict(d_model=8, d_ff=4, num_experts=8, top_k=2) | change
    with pytest.raises(ValueError, match=pattern):
        djax.MoE(**options, rngs=nnx.Rngs(0))


def test_bad_input_and_unconvertible_layers():
    layer = djax.MoE(8, 4, 4, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x must have shape \[..., d_model=8\]"):
        layer(jnp.ones((3, 6)))
    with pytest.raises(ValueError, match="no FP8 recipes"):
        djax.MoE.from_torch(dropless.MoE(8, 4, 4, 2, recipe="rowwise"))
