"""What a result file records about the run: device, library versions, commit, date."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import re
import subprocess
from pathlib import Path

import torch
import triton

from dropless.backend import use_triton


def device_name(device: torch.device) -> str:
    """The GPU's marketing name (``NVIDIA H100 80GB HBM3``), or ``cpu`` with the processor if known."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor()})" if platform.processor() else "cpu"


def slug(name: str) -> str:
    """A file-name-safe form of ``name``: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower().split(" (")[0]).strip("-") or "device"


def git_commit() -> str:
    """The checkout's short commit, ``+dirty`` if tracked files differ from it; ``unknown`` outside git."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def describe(device: torch.device, dtype: torch.dtype, commit: str | None = None) -> dict:
    """The ``meta`` block of a result file; ``commit`` overrides the one read from git."""
    return {
        "gpu": device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit or git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": str(dtype).removeprefix("torch."),
        "dropless_backend": "triton" if use_triton(device) else "reference",
        "peer_packages": peer_packages(),
    }


def peer_packages() -> dict[str, str | None]:
    """Versions of the optional peers' packages (None: not installed)."""
    versions: dict[str, str | None] = {}
    for name in ("quack-kernels", "nvidia-cutlass-dsl"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions
