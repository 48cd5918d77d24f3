"""Which implementation runs an op: the Triton kernels or the PyTorch reference.

``auto`` (the default) runs CUDA tensors on the Triton kernels and everything else on the reference.
Override with ``dropless.set_backend("triton" | "reference" | "auto")`` or the environment variable
``DROPLESS_BACKEND``. Forcing ``triton`` on CPU tensors runs the kernels under Triton's interpreter
(``TRITON_INTERPRET=1``, small shapes only).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "reference")
_backend: str | None = None


def set_backend(name: str) -> None:
    """Choose the backend for all later calls: ``"auto"``, ``"triton"`` or ``"reference"``."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    """The backend in force: the last ``set_backend``, else ``$DROPLESS_BACKEND``, else ``"auto"``."""
    name = _backend or os.environ.get("DROPLESS_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"DROPLESS_BACKEND must be one of {BACKENDS}, got {name!r}")
    return name


def use_triton(device: torch.device, name: str | None = None) -> bool:
    """True when an op on ``device`` runs the Triton kernels under the backend ``name`` (default: the one
    in force, ``get_backend()``)."""
    name = name or get_backend()
    if name == "auto":
        return device.type == "cuda"
    return name == "triton"
