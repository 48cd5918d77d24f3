"""dropless.jax.ragged_dot and grouped_mm against a float64 numpy oracle and jax.lax.ragged_dot, on the
reference backend and on the kernels (Triton's interpreter on the CPU, inside XLA through buffer
callbacks): values, gradients, jit, vmap, shard_map, and bad input."""

from __future__ import annotations

import functools

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402
from jax_helpers import assert_close, assert_rows_close, oracle_mm, oracle_wgrad, randn  # noqa: E402

from dropless import jax as djax  # noqa: E402

# XLA's op at full fp32 (its default on GPUs rounds fp32 operands to TF32; the kernels do not).
HIGHEST = jax.lax.Precision.HIGHEST

# (sizes, M): zeros, one giant group, sizes no tile divides, rows past the last group, all empty.
CASES = [
    ([5, 0, 20, 7], 37),
    ([0, 61, 0], 64),
    ([3, 1, 0, 0, 9, 2], 15),
    ([0, 0], 6),
]


def _sizes_id(case):
    return "-".join(map(str, case[0])) + f"-M{case[1]}"


@pytest.mark.parametrize("case", CASES, ids=_sizes_id)
@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
def test_forward_and_gradients_match_the_oracle(backend, case, transposed):
    sizes, M = case
    K, N, G = 24, 40, len(sizes)
    rng = np.random.default_rng([*sizes, M, transposed])
    x, dy = randn(rng, (M, K), jnp.float32), randn(rng, (M, N), jnp.float32)
    w = randn(rng, (G, N, K) if transposed else (G, K, N), jnp.float32)
    w_kn = jnp.swapaxes(w, 1, 2) if transposed else w
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def f(x, w):
        return djax.grouped_mm(x, w, group_sizes=group_sizes, transposed=transposed)

    y, vjp = jax.vjp(jax.jit(f), x, w)
    assert y.dtype == jnp.float32
    assert_rows_close(y, oracle_mm(x, w_kn, sizes), sizes, jnp.float32)
    dx, dw = jax.jit(vjp)(dy)
    assert_rows_close(dx, oracle_mm(dy, jnp.swapaxes(w_kn, 1, 2), sizes), sizes, jnp.float32, "dx")
    dw_ref = oracle_wgrad(x, dy, sizes)
    assert_close(dw, dw_ref.transpose(0, 2, 1) if transposed else dw_ref, jnp.float32, "dw")
    for g, size in enumerate(sizes):
        if size == 0:
            assert (np.asarray(dw[g]) == 0).all(), f"dw[{g}] of an empty group is not zero"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_16_bit_operands_and_fp32_result(backend, dtype):
    sizes, M, K, N = [9, 0, 30], 44, 32, 48
    rng = np.random.default_rng(7)
    x, w = randn(rng, (M, K), dtype), randn(rng, (3, K, N), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    ref = oracle_mm(x, w, sizes)
    y = jax.jit(lambda x, w: djax.ragged_dot(x, w, group_sizes))(x, w)
    assert y.dtype == dtype
    assert_rows_close(y, ref, sizes, dtype)
    y32 = jax.jit(lambda x, w: djax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32))(x, w)
    assert y32.dtype == jnp.float32
    assert_rows_close(y32, ref, sizes, dtype, "y (fp32 result)")
    dx, dw = jax.grad(lambda x, w: djax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).sum(),
                      argnums=(0, 1))(x, w)
    assert dx.dtype == dtype and dw.dtype == dtype
    ones = jnp.ones((M, N), dtype)
    assert_rows_close(dx, oracle_mm(ones, jnp.swapaxes(w, 1, 2), sizes), sizes, dtype, "dx")
    assert_close(dw, oracle_wgrad(x, ones, sizes), dtype, "dw")


def test_matches_jax_lax_ragged_dot_and_its_gradient(backend):
    sizes, M, K, N = [4, 17, 0, 11], 40, 16, 24
    rng = np.random.default_rng(3)
    x, w, ct = randn(rng, (M, K), jnp.float32), randn(rng, (4, K, N), jnp.float32), randn(rng, (M, N), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    ours = jax.vjp(lambda x, w: djax.ragged_dot(x, w, group_sizes), x, w)
    theirs = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, group_sizes, precision=HIGHEST), x, w)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(ours[1](ct), theirs[1](ct)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def test_offsets_and_offs_alias(backend):
    sizes, M = [6, 0, 13], 22
    rng = np.random.default_rng(5)
    x, w = randn(rng, (M, 16), jnp.float32), randn(rng, (3, 16, 8), jnp.float32)
    ends = jnp.asarray(np.cumsum(sizes), jnp.int32)
    ref = oracle_mm(x, w, sizes)
    assert_rows_close(djax.grouped_mm(x, w, ends), ref, sizes, jnp.float32)
    assert_rows_close(djax.grouped_mm(x, w, offs=ends), ref, sizes, jnp.float32)


def test_vmap_over_a_batch_of_problems(backend):
    sizes = [[3, 9, 0], [0, 12, 1]]
    rng = np.random.default_rng(11)
    x, w = randn(rng, (2, 14, 16), jnp.float32), randn(rng, (2, 3, 16, 8), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    y = jax.jit(jax.vmap(djax.ragged_dot))(x, w, group_sizes)
    for b in range(2):
        assert_rows_close(y[b], oracle_mm(x[b], w[b], sizes[b]), sizes[b], jnp.float32, f"y[{b}]")


def test_gradients_through_scan_remat_and_vmap_match_xla_s_op(backend):
    """Layers scanned over (as MaxText stacks them), rematerialized, and batched, differentiated."""
    rng = np.random.default_rng(41)
    M, K, G = 20, 16, 3
    x, ws = randn(rng, (M, K), jnp.float32), 0.3 * randn(rng, (4, G, K, K), jnp.float32)
    group_sizes = jnp.asarray([5, 0, 12], jnp.int32)

    def stacked(x, ws, dot):
        def layer(h, w):
            return jnp.tanh(jax.checkpoint(dot)(h, w, group_sizes)), None
        return jax.lax.scan(layer, x, ws)[0].sum()

    def batched(xs, w, dot):
        if dot is djax.ragged_dot:
            return jax.vmap(lambda x: dot(x, w, group_sizes))(xs).sum()
        return sum(dot(x, w, group_sizes).sum() for x in xs)  # XLA's op has no batching rule for this

    for f, args in ((stacked, (x, ws)), (batched, (jnp.stack([x, -x]), ws[0]))):
        ours = jax.jit(jax.grad(lambda *a: f(*a, djax.ragged_dot), argnums=(0, 1)))(*args)
        theirs = jax.grad(lambda *a: f(*a, functools.partial(jax.lax.ragged_dot, precision=HIGHEST)),
                          argnums=(0, 1))(*args)
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_under_shard_map_each_device_runs_its_own_groups(backend):
    devices = jax.devices()[:4]
    if len(devices) < 2:
        pytest.skip("needs several JAX devices")
    D, M, K, N, G = len(devices), 12, 16, 8, 3
    rng = np.random.default_rng(13)
    sizes = [[int(s) for s in rng.multinomial(M - d, [1 / G] * G)] for d in range(D)]
    x, w = randn(rng, (D * M, K), jnp.float32), randn(rng, (D * G, K, N), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32).reshape(-1)
    mesh = Mesh(np.array(devices), ("d",))
    spec = PartitionSpec("d")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    def local(x, w, group_sizes):
        return djax.ragged_dot(x, w, group_sizes)

    y = local(x, w, group_sizes)
    for d in range(D):
        rows = slice(d * M, (d + 1) * M)
        assert_rows_close(y[rows], oracle_mm(x[rows], w[d * G:(d + 1) * G], sizes[d]), sizes[d], jnp.float32,
                          f"device {d}")


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_gradients_under_shard_map_with_replicated_weights(backend, jit):
    """Tokens split over the devices, the weights replicated: each weight's gradient sums every device's
    rows, as without shard_map."""
    devices = jax.devices()[:2]
    if len(devices) < 2:
        pytest.skip("needs several JAX devices")
    rng = np.random.default_rng(43)
    x, w = randn(rng, (16, 12), jnp.float32), randn(rng, (3, 12, 8), jnp.float32)
    sizes = [[2, 0, 5], [4, 3, 0]]
    mesh, split = Mesh(np.array(devices), ("d",)), PartitionSpec("d")

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(split, PartitionSpec(), split), out_specs=PartitionSpec())
    def loss(x, w, group_sizes):
        return jax.lax.psum((djax.ragged_dot(x, w, group_sizes) ** 2).sum(), "d")

    grad = jax.grad(loss, argnums=(0, 1))
    dx, dw = (jax.jit(grad) if jit else grad)(x, w, jnp.asarray(sizes, jnp.int32).reshape(-1))
    expected = jax.grad(lambda x, w: sum((jax.lax.ragged_dot(x[8 * d:8 * d + 8], w, jnp.asarray(s), precision=HIGHEST) ** 2).sum()
                                         for d, s in enumerate(sizes)), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(dx, expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, expected[1], rtol=1e-5, atol=1e-5)


def test_empty_dimensions(backend):
    rng = np.random.default_rng(17)
    group_sizes = jnp.asarray([0, 0], jnp.int32)
    y = djax.ragged_dot(jnp.zeros((0, 8), jnp.float32), randn(rng, (2, 8, 4), jnp.float32), group_sizes)
    assert y.shape == (0, 4)
    x = randn(rng, (5, 0), jnp.float32)
    y, vjp = jax.vjp(lambda x, w: djax.ragged_dot(x, w, jnp.asarray([2, 3], jnp.int32)), x,
                     jnp.zeros((2, 0, 4), jnp.float32))
    assert y.shape == (5, 4) and (np.asarray(y) == 0).all()
    dx, dw = vjp(randn(rng, (5, 4), jnp.float32))
    assert dx.shape == (5, 0) and dw.shape == (2, 0, 4)


def test_float64_on_the_reference_backend(reference_backend):
    sizes, M = [2, 0, 7], 11
    rng = np.random.default_rng(19)
    with jax.enable_x64(True):
        x, w = randn(rng, (M, 8), jnp.float64), randn(rng, (3, 8, 5), jnp.float64)
        y = djax.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32))
        assert y.dtype == jnp.float64
        assert_rows_close(y, oracle_mm(x, w, sizes), sizes, jnp.float64)


def test_the_backend_is_chosen_at_trace_time(backend, monkeypatch):
    from dropless.jax import kernel_calls

    name, _ = backend
    calls = []
    original = kernel_calls.ragged_m
    monkeypatch.setattr(kernel_calls, "ragged_m", lambda *a: calls.append(1) or original(*a))
    rng = np.random.default_rng(23)
    djax.ragged_dot(randn(rng, (6, 8), jnp.float32), randn(rng, (2, 8, 4), jnp.float32), jnp.asarray([3, 3]))
    assert bool(calls) == (name == "triton")


def test_replace_ragged_dot_points_xla_s_op_at_the_kernels(triton_backend, monkeypatch):
    from dropless.jax import kernel_calls

    calls = []
    original = kernel_calls.ragged_m
    monkeypatch.setattr(kernel_calls, "ragged_m", lambda *a: calls.append(1) or original(*a))
    sizes, M = [3, 0, 8], 13
    rng = np.random.default_rng(37)
    x, w = randn(rng, (M, 8), jnp.float32), randn(rng, (3, 8, 4), jnp.float32)

    def model(x, w):  # written against XLA's op, as MaxText's MoE is
        return jax.lax.ragged_dot(lhs=x, rhs=w, group_sizes=jnp.asarray(sizes), precision=jax.lax.Precision.DEFAULT,
                                  preferred_element_type=jnp.float32)

    with djax.replace_ragged_dot():
        y = jax.jit(model)(x, w)
    assert calls and jax.lax.ragged_dot is not djax.ragged_dot
    assert_rows_close(y, oracle_mm(x, w, sizes), sizes, jnp.float32)


BAD = [
    ("x", ValueError, "x must have 2 dimensions", lambda x, w, g: djax.ragged_dot(x[None], w, g)),
    ("w", ValueError, r"w must have shape \[G, K, N\] with K=8", lambda x, w, g: djax.ragged_dot(x, w[:, :4], g)),
    ("w-nk", ValueError, r"w must have shape \[G, N, K\] with K=8",
     lambda x, w, g: djax.grouped_mm(x, w, group_sizes=g, transposed=True)),
    ("group_sizes-len", ValueError, r"group_sizes must have shape \[G\] = \[2\]",
     lambda x, w, g: djax.ragged_dot(x, w, g[:1])),
    ("group_sizes-dtype", TypeError, "group_sizes must have an integer dtype",
     lambda x, w, g: djax.ragged_dot(x, w, g.astype(jnp.float32))),
    ("x-dtype", TypeError, "x must have dtype in", lambda x, w, g: djax.ragged_dot(x.astype(jnp.int32), w, g)),
    ("both", ValueError, "pass offsets or its alias offs", lambda x, w, g: djax.grouped_mm(x, w, g, offs=g)),
    ("none", ValueError, "exactly one of offsets", lambda x, w, g: djax.grouped_mm(x, w)),
    ("group_offset", NotImplementedError, "group_offset", lambda x, w, g: djax.ragged_dot(x, w, g, group_offset=g)),
    ("out_sharding", NotImplementedError, "out_sharding", lambda x, w, g: djax.ragged_dot(x, w, g, out_sharding=1)),
    ("empty-w", ValueError, r"at least one group", lambda x, w, g: djax.ragged_dot(x, w[:0], g[:0])),
    ("not-array", TypeError, "w must be a jax array", lambda x, w, g: djax.ragged_dot(x, [[1.0]], g)),
]


@pytest.mark.parametrize("name, error, pattern, call", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_naming_the_argument(backend, name, error, pattern, call):
    rng = np.random.default_rng(29)
    x, w = randn(rng, (6, 8), jnp.float32), randn(rng, (2, 8, 4), jnp.float32)
    with pytest.raises(error, match=pattern):
        call(x, w, jnp.asarray([2, 4], jnp.int32))


def test_kernels_take_only_their_dtypes_and_result_types(triton_backend):
    rng = np.random.default_rng(31)
    x, w = randn(rng, (6, 8), jnp.bfloat16), randn(rng, (2, 8, 4), jnp.bfloat16)
    with pytest.raises(TypeError, match="the result's dtype must be the operands'"):
        djax.ragged_dot(x, w, jnp.asarray([2, 4]), preferred_element_type=jnp.float16)
