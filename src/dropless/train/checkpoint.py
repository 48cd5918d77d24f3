"""Checkpoints of ``dropless train`` in one safetensors file: model, optimizer, random states, run record.

Tensors, by key: ``model.<name>`` (the model's state dict, the routers' expert-bias buffers
included), ``optimizer.<param index>.<name>`` (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``),
``rng.torch``, ``rng.cuda`` (on a GPU) and ``rng.sampler`` (the batch sampler's generator). The
metadata (safetensors keeps strings) holds JSON: ``format``, ``preset``, ``model_config``,
``train_config``, ``world_size``, ``data``, ``step``, ``history``, ``optimizer_param_groups`` and
``python_rng``. Restoring all of it continues a run exactly where it stopped. An expert-parallel run
(``--ep``) writes its experts' weights and moments whole, gathered from their ranks, so a checkpoint
resumes at any EP size.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dropless.train.errors import TrainError
from dropless.train.model import MoELanguageModel
from dropless.train.presets import ModelConfig

FORMAT = "dropless-train/1"
CHECKPOINT_NAME = "checkpoint.safetensors"


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, sampler_state: torch.Tensor,
                    meta: dict, states: tuple[dict, dict] | None = None) -> None:
    """Write ``path`` (atomically: a temporary file renamed over it). ``meta``: JSON-ready values by key.
    ``states``: the ``(model, optimizer)`` state dicts to write instead of those of ``model`` and
    ``optimizer`` (the full tensors of an expert-parallel run)."""
    from safetensors.torch import save_file

    model_state, optimizer_state = states or (model.state_dict(), optimizer.state_dict())
    tensors = {f"model.{name}": t for name, t in model_state.items()}
    for index, state in optimizer_state["state"].items():
        tensors.update({f"optimizer.{index}.{name}": t for name, t in state.items()})
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    tensors["rng.sampler"] = sampler_state
    # A captured step keeps its learning rates in device tensors (captured_step.py): saved as numbers.
    groups = [{k: float(v) if isinstance(v, torch.Tensor) else v for k, v in group.items()}  # sync-ok: saving
              for group in optimizer_state["param_groups"]]
    meta = {**meta, "format": FORMAT, "optimizer_param_groups": groups,
            "python_rng": random.getstate()}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, str(partial),  # sync-ok: saving
              metadata={k: json.dumps(v) for k, v in meta.items()})
    os.replace(partial, path)


@dataclass
class Checkpoint:
    """A checkpoint read back: its tensors (on the CPU) by key and its metadata decoded from JSON."""

    path: Path
    tensors: dict[str, torch.Tensor]
    meta: dict

    def section(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors under ``prefix.``, keyed by the rest of their name."""
        start = prefix + "."
        return {k[len(start):]: t for k, t in self.tensors.items() if k.startswith(start)}

    def model_config(self) -> ModelConfig:
        try:
            return ModelConfig(**self.meta["model_config"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TrainError(f"{self.path}: its model config cannot be read by this version of dropless "
                             f"({exc})") from None


def read_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint of ``dropless train``; TrainError if it is missing or is not one."""
    from safetensors import SafetensorError, safe_open

    if not Path(path).is_file():
        raise TrainError(f"{path}: no such checkpoint")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise TrainError(f"{path}: not a readable safetensors file ({exc})") from None
    if json.loads(metadata.get("format", "null")) != FORMAT:
        raise TrainError(f"{path}: not a checkpoint of dropless train (format {FORMAT})")
    return Checkpoint(Path(path), tensors, {k: json.loads(v) for k, v in metadata.items()})


def restore_optimizer_and_rng(checkpoint: Checkpoint, optimizer: torch.optim.Optimizer,
                              shard: Callable[[dict], dict] = lambda state: state) -> torch.Tensor:
    """Load the optimizer (its state dict passed through ``shard`` first: an expert-parallel run cuts it
    to its experts) and the random states of ``checkpoint``; returns the batch sampler's state."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in checkpoint.section("optimizer").items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = t
    optimizer.load_state_dict(shard({"state": state, "param_groups": checkpoint.meta["optimizer_param_groups"]}))
    torch.set_rng_state(checkpoint.tensors["rng.torch"])
    if "rng.cuda" in checkpoint.tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(checkpoint.tensors["rng.cuda"])
    version, internal, gauss_next = checkpoint.meta["python_rng"]
    random.setstate((version, tuple(internal), gauss_next))
    return checkpoint.tensors["rng.sampler"]


def load_model(path: Path, device: torch.device) -> tuple[MoELanguageModel, Checkpoint]:
    """The trained model of a checkpoint, on ``device`` in eval mode, and the checkpoint itself."""
    checkpoint = read_checkpoint(path)
    model = MoELanguageModel(checkpoint.model_config())
    model.load_state_dict(checkpoint.section("model"))
    return model.to(device).eval(), checkpoint
