"""dropless.jax on a GPU: the kernels inside XLA against a PyTorch fp32 oracle in BF16 and FP16, forward
and backward, inside jax.jit, at the benchmark shapes (both routings) and at the hard group-size cases;
and the layer against the PyTorch layer on the same weights."""

from __future__ import annotations

import pytest
import torch

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import dropless  # noqa: E402
from dropless import jax as djax  # noqa: E402
from dropless.bench.routing import group_sizes as bench_group_sizes  # noqa: E402
from dropless.bench.shapes import SHAPES  # noqa: E402


def _jax_gpu() -> bool:
    try:
        return bool(jax.devices("gpu")) and torch.cuda.is_available()
    except RuntimeError:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _jax_gpu(), reason="needs JAX and PyTorch on a CUDA GPU")]
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 5e-3}


def _torch(a: jax.Array) -> torch.Tensor:
    return torch.from_dlpack(a)


def _oracle(x: torch.Tensor, w_kn: torch.Tensor, dy: torch.Tensor, sizes: list[int]):
    """fp32 y, dx and dw, group by group, on the GPU."""
    x, w, dy = x.float(), w_kn.float(), dy.float()
    y, dx = torch.zeros(x.shape[0], w.shape[2], device=x.device), torch.zeros_like(x)
    dw = torch.zeros_like(w)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        y[rows] = x[rows] @ w[g]
        dx[rows] = dy[rows] @ w[g].T
        dw[g] = x[rows].T @ dy[rows]
        start += size
    return y, dx, dw


def _check(got: jax.Array, ref: torch.Tensor, dtype, what: str) -> None:
    got = _torch(got).float()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = (torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


def _run(sizes: list[int], M: int, K: int, N: int, dtype, transposed: bool) -> None:
    key = jax.random.key(len(sizes) * 7919 + M)
    kx, kw, kd = jax.random.split(key, 3)
    G = len(sizes)
    x = jax.random.normal(kx, (M, K), dtype)
    w = jax.random.normal(kw, (G, N, K) if transposed else (G, K, N), dtype) / K**0.5
    dy = jax.random.normal(kd, (M, N), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)

    @jax.jit
    def fwd_bwd(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: djax.grouped_mm(x, w, group_sizes=group_sizes, transposed=transposed), x, w)
        return (y, *vjp(dy))

    y, dx, dw = fwd_bwd(x, w, dy)
    w_kn = _torch(jnp.swapaxes(w, 1, 2) if transposed else w)
    y_ref, dx_ref, dw_ref = _oracle(_torch(x), w_kn, _torch(dy), sizes)
    _check(y, y_ref, dtype, "y")
    _check(dx, dx_ref, dtype, "dx")
    _check(jnp.swapaxes(dw, 1, 2) if transposed else dw, dw_ref, dtype, "dw")
    tail = _torch(y)[sum(sizes):]
    assert (tail == 0).all(), "rows past the last group are not zero"


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_benchmark_shapes_bf16(shape, routing):
    _run(bench_group_sizes(shape.E, shape.M, routing), shape.M, shape.K, shape.N, jnp.bfloat16, transposed=True)


HARD = {
    "zeros-and-tail": ([0, 300, 0, 17, 1000, 0], 1500),
    "one-giant": ([0, 4093, 0, 0], 4096),
    "all-empty": ([0, 0, 0], 64),
    "ragged-sizes": ([1, 127, 129, 255, 3, 0, 511], 1100),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("case", list(HARD))
def test_hard_group_sizes(case, transposed, dtype):
    sizes, M = HARD[case]
    _run(sizes, M, 1000, 1536, dtype, transposed)


def test_the_layer_on_the_gpu_equals_the_pytorch_layer():
    torch.manual_seed(0)
    moe = dropless.MoE(512, 256, 16, 2, num_shared_experts=1).cuda().bfloat16()
    layer = djax.MoE.from_torch(moe)
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    y = nnx.jit(lambda layer, x: layer(x))(layer, jnp.asarray(x.float().cpu().numpy(), jnp.bfloat16))
    _check(y, moe(x).float(), jnp.bfloat16, "y")
