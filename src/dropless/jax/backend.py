"""Which path a ``dropless.jax`` op takes: the project's Triton kernels inside XLA, or plain JAX.

The same switch as the PyTorch side (``dropless.set_backend`` or ``$DROPLESS_BACKEND``): ``"auto"``
runs the kernels when JAX computes on a GPU and their plain-JAX versions (``reference``) elsewhere;
``"triton"`` forces the kernels, which on the CPU need Triton's interpreter (``TRITON_INTERPRET=1``,
small shapes only); ``"reference"`` forces plain JAX. The choice is made when a function is traced,
from ``jax.default_backend()``: a function jitted before ``set_backend`` keeps the path it was traced
with.
"""

from __future__ import annotations

import jax

from dropless.backend import get_backend
from dropless.kernels.launch import interpreting


def platform() -> str:
    """The platform JAX computes on by default: ``"gpu"``, ``"cpu"``, ..."""
    return jax.default_backend()


def use_kernels() -> bool:
    """True when the ops traced now run the Triton kernels. Raises RuntimeError where they cannot."""
    name = get_backend()
    if name == "reference" or (name == "auto" and platform() != "gpu"):
        return False
    if platform() == "cpu" and not interpreting():
        raise RuntimeError("the Triton backend on the CPU needs TRITON_INTERPRET=1 (set before triton is "
                           "imported); use the reference backend otherwise")
    if platform() not in ("gpu", "cpu"):
        raise RuntimeError(f"the Triton backend runs on CUDA GPUs (or the CPU interpreter), not on {platform()}")
    return True
