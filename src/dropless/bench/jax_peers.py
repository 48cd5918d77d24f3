"""The JAX benchmark's methods, its timer (one for every method) and what it records about JAX.

The one module of ``dropless.bench`` that imports JAX. Before it does, it sets JAX's GPU memory
options where the user has not: by default JAX reserves 75% of the GPU when it starts, which would
leave the PyTorch method timed in the same process too little. With
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` JAX's pool grows as its computations ask, up to
``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the GPU (0.75 unless set), and keeps what it took for its later
computations (nothing hands it back), so the PyTorch side always has the rest. JAX reads both when its
backend starts, at its first computation.

Every JAX method works on the problem's own operands, viewed as JAX arrays through DLPack (the same
memory, no copy), jitted per pass: ``fwd`` is the product; ``fwd+bwd`` is the product and its
``jax.vjp`` pulled back with the problem's random ``dy`` (a random cotangent, so no part of the
backward folds away), returning ``(y, dx, dw)`` as the PyTorch methods do.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from collections.abc import Callable
from typing import Any

MEMORY_OPTIONS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import torch  # noqa: E402

from dropless import jax as djax  # noqa: E402
from dropless.bench.peers import Case, Dropless, Method  # noqa: E402
from dropless.bench.problem import Problem  # noqa: E402
from dropless.bench.timing import queued_median_ms  # noqa: E402
from dropless.jax.backend import use_kernels  # noqa: E402

Product = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _fwd_bwd(product: Product, x: jax.Array, w: jax.Array, sizes: jax.Array,
             dy: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(y, dx, dw)``: the product and its gradients in x and w for the output gradient ``dy``."""
    y, pullback = jax.vjp(lambda a, b: product(a, b, sizes), x, w)
    return (y, *pullback(dy))


def _torch(a: jax.Array) -> torch.Tensor:
    """A JAX result as a torch tensor on its device (DLPack, no copy), for the fp32 check."""
    return torch.from_dlpack(a)


class JaxMethod(Method):
    """``y = product(x [M, K], w [E, K, N], sizes int32 [E])`` in JAX, on the problem's operands."""

    product: Product

    def __init__(self, p: Problem) -> None:
        super().__init__(p)
        self.x, self.w, self.dy = (jnp.from_dlpack(t) for t in (p.x, p.w, p.dy))
        self.sizes = jnp.asarray(p.sizes, dtype=jnp.int32)

    def case(self, pass_: str) -> Case:
        x, w, sizes, dy = self.x, self.w, self.sizes, self.dy
        if pass_ == "fwd":
            fwd = jax.jit(self.product)
            return Case(lambda: fwd(x, w, sizes), lambda y: (_torch(y),))
        if pass_ == "fwd+bwd":
            step = jax.jit(functools.partial(_fwd_bwd, self.product))
            return Case(lambda: step(x, w, sizes, dy), lambda r: tuple(_torch(a) for a in r))
        raise ValueError(f"the JAX benchmark has no pass {pass_!r}")


class DroplessJax(JaxMethod):
    """``dropless.jax.ragged_dot``: the project's kernels inside XLA (``jax.lax.ragged_dot`` on the
    reference backend)."""

    product = staticmethod(djax.ragged_dot)


class LaxRaggedDot(JaxMethod):
    """``jax.lax.ragged_dot`` with XLA's own lowering and gradient: what a JAX user has today."""

    product = staticmethod(jax.lax.ragged_dot)


class DenseJnp(JaxMethod):
    """One jnp matmul of the same FLOPs on all M rows and the first expert's weight: the ceiling."""

    oracle = "dense"

    def __init__(self, p: Problem) -> None:
        super().__init__(p)
        self.w = self.w[0]

    @staticmethod
    def product(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
        return x @ w


# In the order of jax_report.LABELS; ``dropless`` is the PyTorch op, timed in the same process.
JAX_METHODS: dict[str, Callable[[Problem], Method]] = {
    "dense": DenseJnp,
    "dropless_jax": DroplessJax,
    "jax_ragged_dot": LaxRaggedDot,
    "dropless": Dropless,
}


def time_queued(run: Callable[[], Any], device: torch.device, warmup: float, rep: float) -> float:
    """The benchmark's timer for every method, JAX and PyTorch alike: the median ms per call of batches
    of queued calls, each batch ended by waiting for the last call's JAX results and for torch's work
    on ``device``. (CUDA events on torch's stream would not see the work JAX puts on its own.)"""

    def wait(result: Any) -> None:
        jax.block_until_ready(result)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return queued_median_ms(run, wait, warmup, rep)


def describe_jax(device: torch.device) -> dict:
    """The meta keys about JAX: versions (CUDA plugins included), the device JAX computes on, the path
    ``dropless.jax`` takes and the memory options in force. ValueError where JAX cannot run beside
    torch's ``device`` (a GPU torch sees and JAX does not, or the other way round)."""
    platform = jax.default_backend()
    if (device.type == "cuda") != (platform == "gpu"):
        raise ValueError(f"torch computes on {device.type} and JAX on {platform}: the benchmark needs both on the "
                         "same device (on a GPU: jax with its CUDA plugin)")
    try:
        kernels = use_kernels()
    except RuntimeError as exc:
        raise ValueError(str(exc)) from exc
    plugins = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()
               if d.metadata["Name"].lower().replace("_", "-").startswith("jax-cuda")}
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "jax_plugins": plugins, "jax_platform": platform,
            "jax_device": jax.devices()[0].device_kind,
            "dropless_jax_backend": "kernels" if kernels else "jax.lax.ragged_dot",
            "xla_memory": {name: os.environ.get(name) for name in MEMORY_OPTIONS}}
