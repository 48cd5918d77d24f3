"""What ``dropless train`` trains: the model and training settings, and the named presets.

The model is a byte-level (256-symbol vocabulary), Mixtral-style decoder-only language model; the
presets size it for a laptop CPU (``tiny``) or one GPU (``small``, ``medium``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """The language model: ``n_layers`` blocks of RMSNorm, rotary attention, RMSNorm and a dropless MoE.

    ``d_ff`` is each expert's hidden width; ``num_experts`` experts, ``top_k`` per token.
    ``aux_loss_coef`` and ``z_loss_coef`` weight the router's load-balancing and z losses in the
    training loss; ``expert_bias`` adds DeepSeek-V3's auxiliary-loss-free balancing bias;
    ``recompute_activation`` keeps the experts' SwiGLU output out of the memory saved for the backward
    (computed again there). ``fp8``: the
    FP8 recipe of the experts' GEMMs (``"rowwise"``, ``"block128"``, ``"mxfp8"``; None: bf16).
    """

    d_model: int
    n_layers: int
    n_heads: int
    num_experts: int
    top_k: int
    d_ff: int
    vocab_size: int = 256
    rope_theta: float = 10_000.0
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    expert_bias: bool = False
    recompute_activation: bool = False
    fp8: str | None = None

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model={self.d_model} must split into n_heads={self.n_heads} heads of even width")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class TrainConfig:
    """One training run: AdamW with linear warm-up to ``lr`` and cosine decay to ``min_lr_ratio * lr``.

    ``batch_size`` sequences of ``seq_len`` tokens per step and per rank. Every ``log_every`` steps the
    progress bar and the loss curve get a point; every ``eval_every`` steps ``eval_batches`` batches of
    held-out text are scored; every ``save_every`` steps (and at the end) a checkpoint is written.
    """

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 500

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_batches", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


# Fields a resumed run may change: they steer how long it runs and how often it reports, not what
# a step computes. (A longer run also stretches the cosine schedule from the resumed step on.)
RUN_CONTROL_FIELDS = frozenset({"steps", "log_every", "eval_every", "eval_batches", "save_every"})


@dataclass(frozen=True)
class Preset:
    """A named model and training setup."""

    name: str
    description: str
    model: ModelConfig
    train: TrainConfig


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("tiny", "the CPU default: a few minutes on 2 cores",
           ModelConfig(d_model=128, n_layers=4, n_heads=4, num_experts=8, top_k=2, d_ff=256),
           TrainConfig(steps=400, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=30,
                       log_every=10, eval_every=50, eval_batches=8, save_every=200)),
    Preset("small", "for one GPU",
           ModelConfig(d_model=512, n_layers=8, n_heads=8, num_experts=8, top_k=2, d_ff=1408),
           TrainConfig(steps=2000, batch_size=32, seq_len=1024, lr=1e-3, warmup_steps=100,
                       log_every=20, eval_every=200, eval_batches=16, save_every=1000)),
    Preset("medium", "for one 80 GB GPU",
           ModelConfig(d_model=1024, n_layers=12, n_heads=16, num_experts=8, top_k=2, d_ff=2816),
           TrainConfig(steps=1000, batch_size=32, seq_len=1024, lr=6e-4, warmup_steps=100,
                       log_every=20, eval_every=200, eval_batches=16, save_every=1000)),
)}


def differences(saved: dict, current: dict, ignore: frozenset[str] = frozenset()) -> list[str]:
    """``"field: a (checkpoint) != b (this run)"`` for every field whose value differs, ``ignore`` left out."""
    fields = sorted((saved.keys() | current.keys()) - ignore)
    return [f"{f}: {saved.get(f)!r} (checkpoint) != {current.get(f)!r} (this run)"
            for f in fields if saved.get(f) != current.get(f)]


def as_dict(config: ModelConfig | TrainConfig) -> dict:
    """The config's fields as a JSON-ready dict."""
    return dataclasses.asdict(config)
