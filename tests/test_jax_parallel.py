"""Expert parallelism in JAX on 2 and 4 CPU devices: dispatch/combine against a numpy oracle of where
every token copy goes (rows, group sizes, the weighted sum, gradients, a bounded buffer), the
expert-parallel dropless.jax.MoE against the single-device layer on the same weights (outputs, losses,
every gradient, both backends, Explicit and Auto mesh axes), the GPU path's lowering to XLA's ragged
all-to-all, and bad input."""

from __future__ import annotations


import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax.sharding import AxisType, Mesh, PartitionSpec  # noqa: E402
from jax_helpers import f64, randn  # noqa: E402

import dropless  # noqa: E402
from dropless import jax as djax  # noqa: E402
from dropless.jax import collective  # noqa: E402

SPLIT = PartitionSpec("ep")


def _mesh(P: int, kind: AxisType = AxisType.Auto, names: tuple[str, ...] = ("ep",)) -> Mesh:
    """P devices along ``names`` (one axis of P, or 2 x P/2)."""
    devices = jax.devices()
    if len(devices) < P:
        pytest.skip(f"needs {P} JAX devices")
    shape = (P,) if len(names) == 1 else (P // 2, 2)
    return Mesh(np.array(devices[:P]).reshape(shape), names, axis_types=(kind,) * len(names))


def _close(got, ref, what: str, tol: float = 2e-5) -> None:
    got, ref = f64(jnp.asarray(got)), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


# ---------------------------------------------------------------------------------------------------
# dispatch / combine


def _arrivals(ids: np.ndarray, P: int, E: int, max_rows: int) -> list[list[tuple[int, int]]]:
    """For each device, the (source token row, slot) of the copies it receives, in order (local expert,
    source device, copy), cut at max_rows."""
    T = ids.shape[0] // P
    L = E // P
    out = []
    for r in range(P):
        rows = [(src * T + t, j) for l in range(L) for src in range(P) for t in range(T)
                for j in range(ids.shape[1]) if ids[src * T + t, j] == r * L + l]
        out.append(rows[:max_rows])
    return out


def _ids(kind: str, P: int, T: int, k: int, E: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "random":
        return np.stack([rng.permutation(E)[:k] for _ in range(P * T)])
    if kind == "one expert":  # device 0 gets every copy, the others receive nothing
        return np.zeros((P * T, k), np.int64)
    if kind == "last device sends nothing":  # its ids are out of range, so dropped
        ids = np.stack([rng.permutation(E)[:k] for _ in range(P * T)])
        ids[(P - 1) * T:] = rng.choice([-1, E, E + 3], size=(T, k))
        return ids
    if kind == "top-E":  # k = E: every token to every expert
        return np.tile(np.arange(E), (P * T, 1))
    raise ValueError(kind)


def _round_trip(P: int, T: int, k: int, E: int, d: int, ids: np.ndarray, max_rows: int | None):
    """dispatch, then each local expert e scales its rows by e + 1, then combine; returns the jitted
    function of (tokens, weights) -> (y, rows, group_sizes, rows_needed)."""
    L = E // P

    def body(tokens, expert_ids, weights):
        rows, group_sizes, handle = djax.dispatch(tokens, expert_ids, "ep", E, max_rows=max_rows)
        first = jax.lax.axis_index("ep") * L
        expert = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows.shape[0]), side="right")
        scale = jnp.where(expert < L, first + expert + 1, 0).astype(rows.dtype)
        y = djax.combine(rows * scale[:, None], handle, weights)
        return y, rows, group_sizes, handle.rows_needed[None]

    mapped = jax.shard_map(body, mesh=_mesh(P), in_specs=SPLIT, out_specs=SPLIT)
    return jax.jit(lambda x, w: mapped(x, jnp.asarray(ids, jnp.int32), w))


ROUTINGS = [(2, "random", 3, 2, 4), (4, "random", 2, 3, 8), (2, "one expert", 3, 2, 4),
            (4, "last device sends nothing", 2, 2, 8), (2, "top-E", 2, 4, 4)]


@pytest.mark.parametrize("P, kind, T, k, E", ROUTINGS, ids=[f"P{r[0]}-{r[1]}" for r in ROUTINGS])
def test_round_trip_sends_every_copy_to_its_expert_and_back(P, kind, T, k, E):
    d = 3
    rng = np.random.default_rng(P * 7 + k)
    ids = _ids(kind, P, T, k, E, rng)
    x, w = randn(rng, (P * T, d), jnp.float32), randn(rng, (P * T, k), jnp.float32)
    y, rows, group_sizes, needed = _round_trip(P, T, k, E, d, ids, None)(x, w)

    R, L = P * T * k, E // P
    arrivals = _arrivals(ids, P, E, R)
    xs, rows = np.asarray(x), np.asarray(rows).reshape(P, R, d)
    for r in range(P):
        expected = [xs[t] for t, _ in arrivals[r]]
        got = rows[r, :len(expected)]
        assert np.array_equal(got, np.asarray(expected).reshape(-1, d)), f"device {r}: rows"
        assert (rows[r, len(expected):] == 0).all(), f"device {r}: padding rows are not zero"
        sizes = [int(np.sum(ids == r * L + l)) for l in range(L)]
        assert np.asarray(group_sizes).reshape(P, L)[r].tolist() == sizes, f"device {r}: group sizes"
        assert int(needed[r]) == len(expected)

    valid = ((ids >= 0) & (ids < E)).astype(np.float64)

    def oracle(x, w):
        return (w[..., None] * (valid * (ids + 1))[..., None] * x[:, None, :]).sum(axis=1)

    _close(y, oracle(f64(x), f64(w)), "y")
    dy = randn(rng, y.shape, jnp.float32)
    _, vjp = jax.vjp(lambda x, w: _round_trip(P, T, k, E, d, ids, None)(x, w)[0], x, w)
    _, vjp_ref = jax.vjp(lambda x, w: oracle(x, w).astype(jnp.float32), x, w)
    for got, ref, name in zip(vjp(dy), vjp_ref(dy), ("dx", "dweights")):
        _close(got, ref, name)


def test_a_smaller_buffer_drops_the_last_rows_and_reports_the_need():
    P, T, k, E, d, max_rows = 2, 4, 2, 4, 3, 5
    rng = np.random.default_rng(3)
    ids = np.zeros((P * T, k), np.int64)
    ids[:, 1] = 1 + rng.integers(0, 3, P * T)  # device 0 is asked for more than 5 rows
    x, w = randn(rng, (P * T, d), jnp.float32), randn(rng, (P * T, k), jnp.float32)
    y, rows, group_sizes, needed = _round_trip(P, T, k, E, d, ids, max_rows)(x, w)
    assert rows.shape == (P * max_rows, d)
    arrivals = _arrivals(ids, P, E, max_rows)
    kept = np.zeros(ids.shape)
    for r in range(P):
        for t, j in arrivals[r]:
            kept[t, j] = 1
        assert int(np.asarray(group_sizes).reshape(P, 2)[r].sum()) == len(arrivals[r])
    assert np.asarray(needed).tolist() == [int(np.sum(ids < 2)), int(np.sum(ids >= 2))]
    assert kept.sum() < ids.size, "the test must drop some copies"
    expected = (f64(w)[..., None] * (kept * (ids + 1))[..., None] * f64(x)[:, None, :]).sum(axis=1)
    _close(y, expected, "y")


def test_no_tokens_dispatch_nothing():
    P, E, d = 2, 4, 3
    y, rows, group_sizes, needed = _round_trip(P, 0, 2, E, d, np.zeros((0, 2), np.int64), None)(
        jnp.zeros((0, d)), jnp.zeros((0, 2)))
    assert y.shape == (0, d) and rows.shape == (0, d)
    assert (np.asarray(group_sizes) == 0).all() and (np.asarray(needed) == 0).all()


def test_combine_sums_in_fp32_and_returns_the_rows_dtype():
    P, T, k, E, d = 2, 3, 2, 4, 8
    rng = np.random.default_rng(5)
    ids = _ids("random", P, T, k, E, rng)
    x = randn(rng, (P * T, d), jnp.bfloat16)
    w = randn(rng, (P * T, k), jnp.float32)
    y = _round_trip(P, T, k, E, d, ids, None)(x, w)[0]
    assert y.dtype == jnp.bfloat16
    expected = (f64(w)[..., None] * (ids + 1)[..., None] * f64(x)[:, None, :]).sum(axis=1)
    _close(y, expected, "y (bf16)", tol=1e-2)


def test_the_gpu_path_lowers_to_xla_ragged_all_to_all(monkeypatch):
    """On a GPU the exchange is jax.lax.ragged_all_to_all: one for dispatch, one for combine, and their
    reverses in the backward pass (lowered here on the CPU, where XLA cannot run it)."""
    monkeypatch.setattr(collective, "platform", lambda: "gpu")
    P, T, k, E, d = 2, 3, 2, 4, 3
    rng = np.random.default_rng(6)
    fn = _round_trip(P, T, k, E, d, _ids("random", P, T, k, E, rng), None)
    x, w = jnp.ones((P * T, d)), jnp.ones((P * T, k))
    assert fn.lower(x, w).as_text().count("ragged_all_to_all") == 2
    grad = jax.jit(jax.grad(lambda x, w: fn(x, w)[0].sum(), argnums=(0, 1)))
    assert grad.lower(x, w).as_text().count("ragged_all_to_all") == 4


def test_the_exchange_keeps_the_contract_of_jax_lax_ragged_all_to_all():
    """The example of jax.lax.ragged_all_to_all's documentation (the emulation on the CPU)."""
    args = {"operand": [[1, 2, 2], [3, 4, 0]], "input_offsets": [[0, 1], [0, 1]], "send_sizes": [[1, 2], [1, 1]],
            "output_offsets": [[0, 0], [1, 2]], "recv_sizes": [[1, 1], [2, 1]]}

    def body(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
        output = jax.lax.pcast(jnp.zeros(4, operand.dtype), "ep", to="varying")
        return collective.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                            recv_sizes, axis_name="ep")

    mapped = jax.shard_map(body, mesh=_mesh(2), in_specs=SPLIT, out_specs=SPLIT)
    arrays = [jnp.asarray(v, jnp.float32 if name == "operand" else jnp.int32).reshape(-1) for name, v in args.items()]
    assert np.asarray(jax.jit(mapped)(*arrays)).tolist() == [1, 3, 0, 0, 2, 2, 4, 0]


# ---------------------------------------------------------------------------------------------------
# The expert-parallel layer


OPTIONS = {
    "mixtral": dict(),
    "deepseek": dict(score_func="sigmoid", n_groups=2, topk_groups=1, expert_bias=True, routed_scaling=2.5,
                     num_shared_experts=1, shared_d_ff=8, z_loss_coef=1e-3),
    "bias-geglu": dict(bias=True, activation="geglu", renormalize=False, aux_loss_coef=0.1),
    "one expert": dict(expert_bias=True),  # a large bias on the last expert takes every token there
    "top-E": dict(),
}
# name -> (d_model, d_ff, E, k, tokens): one set of weight shapes, so that building them compiles once.
SHAPES = {"mixtral": (8, 6, 4, 2, (2, 4)), "deepseek": (8, 6, 4, 2, (8,)), "bias-geglu": (8, 6, 4, 1, (8,)),
          "one expert": (8, 6, 4, 1, (4,)), "top-E": (8, 6, 4, 4, (4,))}
PARAMS = ("router_weight", "experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias",
          "shared_gate_up", "shared_down")


def _layers(name: str, mesh: Mesh):
    """The single-device layer and the expert-parallel one (built under ``mesh``) on the same weights."""
    d, f, E, k, _ = SHAPES[name]
    single = djax.MoE(d, f, E, k, **OPTIONS[name], rngs=nnx.Rngs(7))
    with jax.set_mesh(mesh):
        parallel = djax.MoE(d, f, E, k, **OPTIONS[name], ep_axis="ep", rngs=nnx.Rngs(7))
    if single.expert_bias is not None:
        bias = np.random.default_rng(1).normal(0, 0.05, E)
        if name == "one expert":
            bias[-1] = 10.0
        for layer in (single, parallel):
            layer.expert_bias.set_value(jnp.asarray(bias, jnp.float32))
    return single, parallel


def _loss(layer, x, g):
    y = layer(x)
    return (y * g).sum() + layer.aux_loss.get_value(), y


def _call(layer, x):
    return nnx.jit(lambda layer, x: layer(x))(layer, x)


# id -> (devices, axis type, axis names); the tokens come split over every axis.
MESHES = {"2": (2, AxisType.Auto, ("ep",)), "4": (4, AxisType.Auto, ("ep",)),
          "2-explicit": (2, AxisType.Explicit, ("ep",)), "data2-ep2": (4, AxisType.Auto, ("data", "ep"))}


def _compare(name: str, mesh_id: str) -> None:
    mesh = _mesh(*MESHES[mesh_id])
    single, parallel = _layers(name, mesh)
    rng = np.random.default_rng(len(name))
    shape = (*SHAPES[name][4], SHAPES[name][0])
    x, g = randn(rng, shape, jnp.float32), randn(rng, shape, jnp.float32)
    # A new jit per call: the backend is chosen when a function is traced.
    (value, y), (grads, dx) = nnx.jit(nnx.value_and_grad(_loss, argnums=(0, 1), has_aux=True))(single, x, g)
    with jax.set_mesh(mesh):
        x_split = jax.device_put(x, jax.sharding.NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
        value_and_grads = nnx.jit(nnx.value_and_grad(_loss, argnums=(0, 1), has_aux=True))
        (ep_value, ep_y), (ep_grads, ep_dx) = value_and_grads(parallel, x_split, g)
    _close(ep_y, y, "y")
    # The loss is <y, g> + aux, a sum that cancels: its error is y's (within tol of ||y||) times ||g||, so it is
    # compared relative to ||y|| ||g|| + |aux|, not to the loss itself.
    scale = np.linalg.norm(f64(y)) * np.linalg.norm(f64(g)) + abs(float(single.aux_loss.get_value()))
    err = abs(float(ep_value) - float(value)) / scale
    assert err <= 2e-5, f"loss: error {err:.3g} of ||y|| ||g|| + |aux| > 2e-05"
    for stat in ("aux_loss", "load_balancing_loss", "z_loss"):
        _close(getattr(parallel, stat).get_value(), getattr(single, stat).get_value(), stat)
    assert np.array_equal(parallel.tokens_per_expert.get_value(), single.tokens_per_expert.get_value())
    if name == "one expert":
        assert int(single.tokens_per_expert.get_value()[-1]) == x.size // x.shape[-1]
    _close(ep_dx, dx, "dx")
    for param in PARAMS:
        if getattr(single, param) is not None:
            _close(getattr(ep_grads, param).get_value(), getattr(grads, param).get_value(), f"d{param}")
    spec = parallel.experts_gate_up.get_value().sharding.spec
    assert spec[0] == "ep", f"the experts are not sharded over the axis: {spec}"
    if MESHES[mesh_id][1] == AxisType.Explicit:
        assert ep_y.sharding.spec[0] == "ep", "the output is not split as the tokens came"


LAYER_CASES = [("mixtral", "2-explicit"), ("deepseek", "data2-ep2"), ("bias-geglu", "2"), ("one expert", "4"),
               ("top-E", "2")]


@pytest.mark.parametrize("name, mesh_id", LAYER_CASES, ids=[f"{n}-{m}" for n, m in LAYER_CASES])
def test_the_layer_equals_the_single_device_layer(reference_backend, name, mesh_id):
    _compare(name, mesh_id)


def test_the_layer_on_both_backends(backend):
    _compare("deepseek", "2-explicit")


def test_no_tokens(reference_backend):
    mesh = _mesh(2)
    _, parallel = _layers("mixtral", mesh)
    with jax.set_mesh(mesh):
        y = _call(parallel, jnp.zeros((0, 8)))
    assert y.shape == (0, 8)
    assert (np.asarray(parallel.tokens_per_expert.get_value()) == 0).all()


def test_from_torch_and_back_with_an_expert_axis(reference_backend):
    mesh = _mesh(2)
    torch.manual_seed(0)
    moe = dropless.MoE(8, 6, 4, 2, num_shared_experts=1)
    x = torch.randn(6, 8)
    with jax.set_mesh(mesh):
        layer = djax.MoE.from_torch(moe, ep_axis="ep")
        y = _call(layer, jnp.asarray(x.numpy()))
    assert layer.experts_down.get_value().sharding.spec[0] == "ep"
    _close(y, moe(x).detach().numpy(), "y")
    for (name, a), b in zip(moe.state_dict().items(), layer.to_torch().state_dict().values()):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------------
# Bad input


def test_dispatch_and_combine_reject_bad_input():
    mesh = _mesh(2)
    x, ids = jnp.ones((4, 3)), jnp.zeros((4, 2), jnp.int32)

    def run(body, *args):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPLIT, out_specs=SPLIT))(*args)

    with pytest.raises(ValueError, match=r"num_experts \(3\) must be a positive multiple of the size of mesh axis"):
        run(lambda x, ids: djax.dispatch(x, ids, "ep", 3)[0], x, ids)
    with pytest.raises(ValueError, match="must run inside shard_map over the mesh axis 'experts'"):
        run(lambda x, ids: djax.dispatch(x, ids, "experts", 4)[0], x, ids)
    with pytest.raises(ValueError, match="must run inside shard_map over the mesh axis 'ep'"):
        djax.dispatch(x, ids, "ep", 4)
    with pytest.raises(TypeError, match="expert_ids must have an integer dtype"):
        run(lambda x, ids: djax.dispatch(x, ids, "ep", 4)[0], x, ids.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"tokens must be \[T, d\] and expert_ids \[T, k\]"):
        run(lambda x, ids: djax.dispatch(x, ids[:1], "ep", 4)[0], x, ids)
    with pytest.raises(ValueError, match="max_rows must be a non-negative int"):
        run(lambda x, ids: djax.dispatch(x, ids, "ep", 4, max_rows=-1)[0], x, ids)

    def bad_combine(rows_cut, weights_cut):
        def body(x, ids):
            rows, _, handle = djax.dispatch(x, ids, "ep", 4)
            return djax.combine(rows[:rows.shape[0] - rows_cut], handle, jnp.ones((2, 2 - weights_cut)))
        return body

    with pytest.raises(ValueError, match=r"rows_out must be \[R=8, d'\]"):
        run(bad_combine(1, 0), x, ids)
    with pytest.raises(ValueError, match=r"weights must be \[T, k\] with T\*k=4"):
        run(bad_combine(0, 1), x, ids)


def test_the_layer_rejects_a_missing_or_unfit_mesh():
    with pytest.raises(ValueError, match=r"MoE\(ep_axis='ep'\) is built and called under a mesh with that axis"):
        djax.MoE(8, 4, 4, 2, ep_axis="ep", rngs=nnx.Rngs(0))
    mesh = _mesh(4)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by the size"):
        djax.MoE(8, 4, 6, 2, ep_axis="ep", rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        layer = djax.MoE(8, 4, 4, 2, ep_axis="ep", rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="the 6 tokens must split evenly over the 4 devices"):
            _call(layer, jnp.ones((6, 8)))
        inside = jax.jit(jax.shard_map(lambda x: layer(x), in_specs=SPLIT, out_specs=SPLIT))
        with pytest.raises(ValueError, match="call it outside shard_map over that axis"):
            inside(jnp.ones((8, 8)))
    with pytest.raises(ValueError, match="is built and called under a mesh with that axis"):
        _call(layer, jnp.ones((8, 8)))
    with jax.set_mesh(_mesh(4, AxisType.Explicit, ("data", "ep"))):
        with pytest.raises(ValueError, match=r"make \['data'\] Auto"):
            djax.MoE(8, 4, 4, 2, ep_axis="ep", rngs=nnx.Rngs(0))
