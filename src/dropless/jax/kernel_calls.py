"""The grouped GEMM kernels as XLA custom calls.

Each op is a ``jax.experimental.buffer_callback``: an XLA FFI call that hands the device buffers of its
operands and results to a launcher at run time, on the stream XLA runs on. The launcher views them as
torch tensors through DLPack (no copy: the same device memory) and launches the project's kernels on
that stream (the Hopper Gluon kernels where they apply, the Triton ones elsewhere), exactly as the
PyTorch ops do, so both front ends run the same kernels with the same configurations. Nothing moves to
the host and nothing waits for it; the launch itself runs a little Python on the host per call.

Tile configurations are the tuners' defaults (the measured winners): timing candidates from inside a
running XLA computation would stall it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax
import numpy as np
import torch
from jax.experimental.buffer_callback import buffer_callback

from dropless.kernels.autotune import untimed
from dropless.kernels.ragged_k import NO_ACCUMULATE
from dropless.kernels.tuning import run_ragged_k, run_ragged_m
from dropless.jax.vma import varying_axes, vary

_DLPACK_CUDA = 2
# XLA runs the computations of several devices (shard_map) on threads of their own. One launch at a time:
# Triton's interpreter patches triton.language while it runs a kernel, and on GPUs the first launch of
# a kernel on each device compiles and fills Triton's caches, which are not made for concurrent
# writers. A launch only enqueues work (it never waits for a device), so the lock is held for
# microseconds once the kernels are compiled.
_launch_lock = threading.Lock()


@contextlib.contextmanager
def _on_xla_stream(ctx, buffer) -> Iterator[None]:
    """Make XLA's stream torch's current one (on a GPU), with tuning off, holding the launch lock."""
    device_type, index = buffer.__dlpack_device__()
    with untimed(), _launch_lock:
        if device_type != _DLPACK_CUDA:
            yield
            return
        device = torch.device("cuda", index)
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.ExternalStream(ctx.stream, device=device)):
            yield


def _launched(run, shape: tuple[int, ...], out_dtype: np.dtype, *operands: jax.Array) -> jax.Array:
    """``run(out, *operands)`` on torch views of the buffers, launched on XLA's stream by a buffer callback
    whose result is ``shape`` in ``out_dtype``."""
    def launch(ctx, out, *buffers) -> None:
        with _on_xla_stream(ctx, out):
            run(torch.from_dlpack(out), *(torch.from_dlpack(b) for b in buffers))

    call = buffer_callback(launch, jax.ShapeDtypeStruct(shape, out_dtype), vmap_method="sequential")
    # A callback's result varies over no manual axis of a shard_map; its operands' may.
    return vary(call(*operands), varying_axes(*operands))


def ragged_m(lhs: jax.Array, rhs: jax.Array, offsets: jax.Array, rhs_nk: bool, out_dtype: np.dtype) -> jax.Array:
    """``out[s_g:t_g] = lhs[s_g:t_g] @ rhs[g]`` (``rhs[g]^T`` with ``rhs_nk``), zero past ``offsets[-1]``.

    lhs: ``[M, K]``; rhs: ``[G, K, N]``, or ``[G, N, K]`` with ``rhs_nk``, lhs's dtype; offsets: int32
    ``[G]`` cumulative group ends. Returns ``[M, N]`` in ``out_dtype`` (lhs's dtype or float32).
    """
    N = rhs.shape[1] if rhs_nk else rhs.shape[2]

    def run(c, a, b, ends) -> None:
        run_ragged_m(a, b.transpose(1, 2) if rhs_nk else b, ends, c)

    return _launched(run, (lhs.shape[0], N), out_dtype, lhs, rhs, offsets)


def ragged_k(lhs: jax.Array, rhs: jax.Array, offsets: jax.Array, out_dtype: np.dtype) -> jax.Array:
    """``out[g] = lhs[s_g:t_g]^T @ rhs[s_g:t_g]``, zero for an empty group; rows past ``offsets[-1]``
    take no part.

    lhs: ``[M, K]``; rhs: ``[M, N]`` of lhs's dtype; offsets: int32 ``[G]``. Returns ``[G, K, N]`` in
    ``out_dtype`` (lhs's dtype or float32).
    """
    def run(c, a, b, ends) -> None:
        run_ragged_k(a, b, ends, c, NO_ACCUMULATE, None)

    return _launched(run, (offsets.shape[0], lhs.shape[1], rhs.shape[1]), out_dtype, lhs, rhs, offsets)
