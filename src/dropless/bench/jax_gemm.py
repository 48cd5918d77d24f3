"""The JAX benchmark: ``dropless.jax.ragged_dot`` against ``jax.lax.ragged_dot``, the PyTorch
``dropless.grouped_mm`` (in the same process) and a dense jnp matmul of the same FLOPs, fwd and fwd+bwd.

It is the GEMM benchmark's run (``run_gemm``): the same shapes, routings and operands (the JAX methods
view the problem's tensors through DLPack), the same fp32 check of each case before it is timed, the
same rounds, rows and result file; a method that raises (``jax.lax.ragged_dot`` out of memory
included) gets a row with its error and the run goes on. What differs: the JAX methods and passes, one
timer for every method (``jax_peers.time_queued``, the host clock over queued calls), the meta keys
about JAX and the ratios of each row to the PyTorch dropless op and to ``jax.lax.ragged_dot``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dropless.bench.gemm import GemmOptions, Timer, run_gemm
from dropless.bench.jax_peers import JAX_METHODS, describe_jax, time_queued
from dropless.bench.jax_report import PASSES, add_ratio_keys
from dropless.bench.peers import Method
from dropless.bench.problem import Problem


@dataclass
class JaxOptions(GemmOptions):
    """The GEMM benchmark's options with the JAX methods (``JAX_METHODS``), passes and timer."""

    passes: Sequence[str] = PASSES
    methods: Sequence[str] = tuple(JAX_METHODS)
    registry: dict[str, Callable[[Problem], Method]] = field(default_factory=lambda: dict(JAX_METHODS))
    timer: Timer = time_queued


def run_jax(opts: JaxOptions) -> dict:
    """Run the benchmark; the GEMM benchmark's result with the JAX keys in ``meta`` and
    ``ratio_to_dropless`` and ``ratio_to_jax_ragged_dot`` in every row."""
    unknown = [p for p in opts.passes if p not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass(es) {unknown}; choose from {list(PASSES)}")
    about_jax = describe_jax(opts.device)
    result = run_gemm(opts)
    result["meta"].update(about_jax, timing="host clock over batches of queued calls, each batch ended by one "
                                            "wait (block_until_ready, torch.cuda.synchronize); every method alike")
    add_ratio_keys(result["rows"])
    return result
