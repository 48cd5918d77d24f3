"""Argument checks shared by the ops: every error names the argument and what was expected."""

from __future__ import annotations

import os

import torch

TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REFERENCE_DTYPES = (*TRITON_DTYPES, torch.float64)
_validate: bool | None = None


def set_validation(enabled: bool) -> None:
    """Opt in to checking ``offsets`` on the device (non-decreasing, within ``[0, M]``).

    The check is asynchronous (``torch._assert_async``): a bad value raises at the next sync point
    instead of the kernel reading out of bounds. Also set by ``DROPLESS_VALIDATE=1``.
    """
    global _validate
    _validate = bool(enabled)


def validation_enabled() -> bool:
    if _validate is not None:
        return _validate
    return os.environ.get("DROPLESS_VALIDATE", "0") == "1"


def check_tensor(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_matrix(name: str, t: torch.Tensor, ndim: int | tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    """``t`` is a tensor of ``ndim`` dimensions (or of one of the counts in a tuple) and one of ``dtypes``."""
    check_tensor(name, t)
    ndims = ndim if isinstance(ndim, tuple) else (ndim,)
    if t.dim() not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {list(dict.fromkeys(map(str, dtypes)))}, got {t.dtype}")


def check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the operands are on {device}")


def check_row_count(rows: object, device: torch.device, of: str) -> None:
    """``rows``, the number of leading rows of ``of`` that hold data (an expert-parallel buffer sized for
    the most a rank can receive), is an int32/int64 tensor of shape [1] on ``device``."""
    check_tensor("rows", rows)
    if rows.shape != (1,) or rows.dtype not in (torch.int32, torch.int64) or rows.device != device:
        raise ValueError(f"rows must be an int32/int64 tensor of shape [1] on {of}'s device {device}, got "
                         f"{rows.dtype} of shape {tuple(rows.shape)} on {rows.device}")


def resolve_offsets(offsets: torch.Tensor | None, group_sizes: torch.Tensor | None, E: int,
                    device: torch.device) -> torch.Tensor:
    """int32 ``[E]`` cumulative group ends on ``device``, from ``offsets`` or ``group_sizes`` (E < 0: as
    many as they hold)."""
    if (offsets is None) == (group_sizes is None):
        raise ValueError("pass exactly one of offsets (cumulative group ends) and group_sizes")
    name, t = ("offsets", offsets) if offsets is not None else ("group_sizes", group_sizes)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor on the operands' device, got {type(t).__name__}")
    if t.dim() != 1 or (E >= 0 and t.shape[0] != E):
        expected = f"[E] = [{E}]" if E >= 0 else "[E]"
        raise ValueError(f"{name} must have shape {expected} (one entry per expert), got {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    check_same_device(device, **{name: t})
    if group_sizes is not None:
        t = torch.cumsum(t, 0)
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def validate_offsets(offsets: torch.Tensor, M: int, dim: str = "M") -> None:
    """Device-side assertion that offsets are non-decreasing and within ``[0, M]`` (when enabled);
    ``dim`` names the dimension they split in the message."""
    if not validation_enabled() or offsets.numel() == 0:
        return
    ok = (offsets[0] >= 0) & (offsets[-1] <= M) & (offsets[1:] >= offsets[:-1]).all()
    torch._assert_async(ok, f"offsets must be non-decreasing and within [0, {dim}={M}]")
