"""The JAX training benchmark: tokens/s of a jitted training step of the JAX ``MoELanguageModel`` against
the PyTorch step of ``dropless train``, at a preset's shape, in one process, on the same data.

Both models start from the same weights (the JAX one is ``MoELanguageModel.from_torch`` of the PyTorch
one) and train on the same byte windows of the same corpus (``dropless.train.data``), drawn in the same
order from generators of the same seed. The methods:

- ``dropless``: ``dropless.train.loop.Trainer.train_step``, the step of ``dropless train`` itself (bf16
  autocast on a GPU, fused AdamW, the batch gathered on the device; ``torch.compile`` off, as the
  command's default);
- ``dropless_jax``: ``dropless.jax.training.train_step`` (one ``nnx.jit`` computation over
  ``nnx.cached_partial``, model and optimizer donated), the batch gathered on the device from the same
  window starts, the model computing in bf16 on a GPU (fp32 on the CPU, as PyTorch without autocast).

Before timing, each model's logits on one batch are checked against the PyTorch model's in fp32 (the
PyTorch fp32 forward is the oracle, so it checks PyTorch's mixed precision too); a method off by more
than the compute dtype's tolerance is reported as failed. Then each method's first step (compilation,
kernel tuning) and ``warmup_steps`` more run untimed, the PyTorch one first, so the grouped GEMMs'
tuners have chosen their configurations before either is timed (the JAX kernels take the configurations
the tuners hold when they launch). Each round times ``steps`` steps of each method back to back (host
clock, one wait at the end: JAX's ``block_until_ready`` and ``torch.cuda.synchronize``), the methods in
a seeded order that changes every round; a method's time is the median of its rounds.

Importing this module imports JAX (through ``jax_peers``, which first lets JAX's GPU memory grow on
demand, leaving the PyTorch side its share).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# First: jax_peers sets JAX's GPU memory options before it imports JAX.
from dropless.bench.jax_peers import describe_jax  # isort: skip

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from dropless.bench.environment import describe  # noqa: E402
from dropless.bench.timing import round_order  # noqa: E402
from dropless.jax.language_model import MoELanguageModel  # noqa: E402
from dropless.jax.training import make_optimizer, train_step  # noqa: E402
from dropless.train.data import Corpus, load_corpus  # noqa: E402
from dropless.train.flops import model_flops_utilization  # noqa: E402
from dropless.train.loop import Trainer  # noqa: E402
from dropless.train.model import MoELanguageModel as TorchLanguageModel  # noqa: E402
from dropless.train.presets import PRESETS, ModelConfig, TrainConfig, as_dict  # noqa: E402

METHODS = ("dropless_jax", "dropless")
LABELS = {"dropless_jax": "dropless.jax (nnx.jit)", "dropless": "dropless train (PyTorch)"}
# Relative Frobenius error of the logits allowed against the PyTorch fp32 forward, by compute dtype.
LOGITS_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
QUICK = dict(preset="tiny", batch_size=4, seq_len=64, steps=2, warmup_steps=1, rounds=1)
FULL = dict(preset="small", steps=20, warmup_steps=5, rounds=3)
# The logits check draws its batch from a generator of its own, not the training ones.
_CHECK_SEED_OFFSET = 1_000_003


@dataclass
class JaxTrainOptions:
    """``steps`` timed steps per method and round, after ``warmup_steps`` untimed ones (the first of them
    reported alone, as ``first_step_s``); ``None`` fields take the quick or full defaults, and the
    batch shape the preset's."""

    preset: str | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    steps: int | None = None
    warmup_steps: int | None = None
    rounds: int | None = None
    methods: Sequence[str] = METHODS
    attention: str | None = None
    quick: bool = False
    seed: int = 0
    commit: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"))

    def resolved(self) -> JaxTrainOptions:
        """A copy with every None count filled in, checked; ValueError names a bad option."""
        defaults = QUICK if self.quick else FULL
        filled = {name: defaults.get(name) if getattr(self, name) is None else getattr(self, name)
                  for name in ("preset", "batch_size", "seq_len", "steps", "warmup_steps", "rounds")}
        if filled["preset"] not in PRESETS:
            raise ValueError(f"unknown preset {filled['preset']!r}; choose from {list(PRESETS)}")
        for name in ("batch_size", "seq_len", "steps", "warmup_steps", "rounds"):
            if filled[name] is not None and filled[name] < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {filled[name]}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
        return dataclasses.replace(self, **filled)

    def configs(self) -> tuple[ModelConfig, TrainConfig]:
        preset = PRESETS[self.preset]
        sizes = {k: v for k, v in (("batch_size", self.batch_size), ("seq_len", self.seq_len)) if v is not None}
        return preset.model, dataclasses.replace(preset.train, seed=self.seed, **sizes)

    def compute_dtype(self) -> torch.dtype:
        """bf16 on a GPU (``dropless train``'s autocast), fp32 on the CPU."""
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32


class _Method:
    """One framework's training step on the shared data: ``step()`` queues a step and returns its device
    results, ``wait(result)`` waits for them, ``loss(result)`` reads the LM loss (a host sync)."""

    name: str
    attention: str

    def step(self) -> Any:
        raise NotImplementedError

    def wait(self, result: Any) -> None:
        raise NotImplementedError

    def loss(self, result: Any) -> float:
        return float(result[0])

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """fp32 logits of ``inputs`` int64 ``[B, T]`` (on the benchmark's device), on the CPU."""
        raise NotImplementedError


class TorchMethod(_Method):
    """``Trainer.train_step`` of ``dropless train``."""

    name = "dropless"
    attention = "F.scaled_dot_product_attention"

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def step(self) -> Any:
        return self.trainer.train_step()

    def wait(self, result: Any) -> None:
        if self.trainer.device.type == "cuda":
            torch.cuda.synchronize(self.trainer.device)

    @torch.no_grad()
    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        self.trainer.model.eval()
        with self.trainer.autocast:
            return self.trainer.model(inputs).float().cpu()


class JaxMethod(_Method):
    """``dropless.jax.training.train_step`` on a JAX copy of the PyTorch model, its batches the same
    windows of the same tokens as the PyTorch sampler's (window starts drawn on the host from a generator
    of the same seed, the windows gathered on the device)."""

    name = "dropless_jax"

    def __init__(self, source: TorchLanguageModel, corpus: Corpus, train_config: TrainConfig, dtype: Any,
                 attention: str | None) -> None:
        self.model = MoELanguageModel.from_torch(source, dtype=dtype, attention=attention, param_dtype=jnp.float32)
        self.attention = self.model.attention
        self.optimizer = make_optimizer(self.model, train_config)
        self.train_step: Callable | None = None
        self.tokens = jnp.asarray(corpus.train.numpy())
        self.batch_size, self.seq_len = train_config.batch_size, train_config.seq_len
        self.generator = torch.Generator().manual_seed(train_config.seed)
        self.window = jnp.arange(self.seq_len + 1)
        self.forward = nnx.jit(lambda model, inputs: model(inputs))

    def step(self) -> Any:
        # BatchSampler.next_batch's draw, one rank.
        starts = torch.randint(0, self.tokens.shape[0] - self.seq_len, (self.batch_size,), generator=self.generator)
        inputs, targets = _windows(self.tokens, jnp.asarray(starts.numpy(), jnp.int32), self.window)
        if self.train_step is None:  # cached after the logits check, which switches the model to eval and back
            self.train_step = nnx.cached_partial(train_step, self.model, self.optimizer)
        return self.train_step(inputs, targets)

    def wait(self, result: Any) -> None:
        jax.block_until_ready(result)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        self.model.eval()  # no load counting for the expert bias, as the PyTorch model in eval mode
        logits = self.forward(self.model, jnp.asarray(inputs.cpu().numpy(), jnp.int32))
        self.model.train()
        return torch.from_numpy(np.array(logits.astype(jnp.float32)))


@jax.jit
def _windows(tokens: jax.Array, starts: jax.Array, window: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``inputs, targets`` int32 ``[B, T]``: the windows of ``tokens`` (uint8) at ``starts``, shifted by one."""
    windows = tokens[starts[:, None] + window].astype(jnp.int32)
    return windows[:, :-1], windows[:, 1:]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return (torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64)).item()


def _check_batch(corpus: Corpus, train_config: TrainConfig, device: torch.device) -> torch.Tensor:
    """int64 ``[B, T]``: one batch of training windows for the logits check."""
    starts = torch.randint(0, corpus.train.numel() - train_config.seq_len, (train_config.batch_size,),
                           generator=torch.Generator().manual_seed(train_config.seed + _CHECK_SEED_OFFSET))
    window = torch.arange(train_config.seq_len)
    return corpus.train[starts[:, None] + window].long().to(device)


def _reference_logits(model: TorchLanguageModel, inputs: torch.Tensor) -> torch.Tensor:
    """The PyTorch model's fp32 logits (no autocast), on the CPU: the check's oracle."""
    model.eval()
    with torch.no_grad():
        return model(inputs).float().cpu()


def _row(method: str, opts: JaxTrainOptions, train_config: TrainConfig, **values: Any) -> dict:
    tokens = train_config.batch_size * train_config.seq_len
    return {"preset": opts.preset, "method": method, "framework": "jax" if method == "dropless_jax" else "pytorch",
            "batch_size": train_config.batch_size, "seq_len": train_config.seq_len, "tokens_per_step": tokens,
            "steps": opts.steps, "rounds": opts.rounds, "attention": None, "max_rel_err": None, "failed": False,
            "first_step_s": None, "first_loss": None, "loss": None, "ms": None, "ms_rounds": [],
            "tokens_per_s": None, "mfu": None, "ratio_to_dropless": None, "error": None} | values


def _timed_steps(method: _Method, steps: int) -> float:
    """Milliseconds per step of ``steps`` steps queued back to back and one wait."""
    start = time.perf_counter()
    for _ in range(steps):
        result = method.step()
    method.wait(result)
    return (time.perf_counter() - start) * 1e3 / steps


def run_jax_train(opts: JaxTrainOptions, log: Callable[[str], None] = print) -> dict:
    """Run the benchmark; ``{"meta": ..., "rows": [...]}``, one row per method (see ``_row``'s keys),
    ``ratio_to_dropless`` the method's tokens/s over the PyTorch step's."""
    opts = opts.resolved()
    about_jax = describe_jax(opts.device)
    model_config, train_config = opts.configs()
    dtype = opts.compute_dtype()
    jax_dtype = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    corpus = load_corpus(None, train_config.seq_len)
    rows: dict[str, dict] = {}
    methods: dict[str, _Method] = {}
    with tempfile.TemporaryDirectory() as out_dir:  # the Trainer's output folder: nothing is written there
        trainer = Trainer(opts.preset, model_config, train_config, corpus, Path(out_dir), opts.device,
                          progress=False)
        check_inputs = _check_batch(corpus, train_config, opts.device)
        reference = _reference_logits(trainer.model, check_inputs)
        builders = {"dropless": lambda: TorchMethod(trainer),
                    "dropless_jax": lambda: JaxMethod(trainer.model, corpus, train_config, jax_dtype, opts.attention)}
        # The JAX copy is taken before any step, so both start from the same weights; PyTorch warms up first.
        for name in sorted(opts.methods, key=lambda m: m != "dropless_jax"):
            try:
                methods[name] = builders[name]()
                err = _rel_err(methods[name].logits(check_inputs), reference)
                rows[name] = _row(name, opts, train_config, attention=methods[name].attention, max_rel_err=err,
                                  failed=not err <= LOGITS_TOL[dtype])
            except Exception as exc:  # noqa: BLE001 -- reported in the row, the other method still runs
                rows[name] = _row(name, opts, train_config, error=_describe_error(exc))
                methods.pop(name, None)
        for name in sorted(methods, key=lambda m: m != "dropless"):
            method, row = methods[name], rows[name]
            try:
                start = time.perf_counter()
                result = method.step()
                row["first_loss"] = method.loss(result)
                row["first_step_s"] = time.perf_counter() - start
                log(f"{name}: first step {row['first_step_s']:.1f} s (compilation, tuning), "
                    f"loss {row['first_loss']:.3f}")
                for _ in range(opts.warmup_steps):
                    result = method.step()
                method.wait(result)
            except Exception as exc:  # noqa: BLE001
                row["error"] = _describe_error(exc)
                methods.pop(name)
        for round_ in range(opts.rounds):
            for name in round_order(sorted(methods), round_, opts.seed):
                try:
                    rows[name]["ms_rounds"].append(_timed_steps(methods[name], opts.steps))
                except Exception as exc:  # noqa: BLE001
                    rows[name]["error"] = _describe_error(exc)
                    methods.pop(name)
        for name, method in methods.items():
            row = rows[name]
            try:  # one more step, so that both methods end at the same step, on the same batches
                row["loss"] = method.loss(method.step())
            except Exception as exc:  # noqa: BLE001
                row["error"] = _describe_error(exc)
                continue
            row["failed"] = row["failed"] or not math.isfinite(row["loss"])
            row["ms"] = statistics.median(row["ms_rounds"])
            row["tokens_per_s"] = row["tokens_per_step"] / (row["ms"] / 1e3)
            row["mfu"] = (model_flops_utilization(row["tokens_per_s"], model_config, train_config.seq_len,
                                                  torch.cuda.get_device_name(opts.device))
                          if opts.device.type == "cuda" else None)
    torch_row = rows.get("dropless")
    for row in rows.values():
        if row["tokens_per_s"] is not None and torch_row is not None and torch_row["tokens_per_s"]:
            row["ratio_to_dropless"] = row["tokens_per_s"] / torch_row["tokens_per_s"]
    meta = describe(opts.device, dtype, opts.commit) | about_jax | {
        "quick": opts.quick, "preset": opts.preset, "model_config": as_dict(model_config),
        "train_config": as_dict(train_config), "data": corpus.name, "steps": opts.steps,
        "warmup_steps": opts.warmup_steps, "rounds": opts.rounds, "seed": opts.seed,
        "logits_tolerance": LOGITS_TOL[dtype],
        "timing": "host clock over `steps` queued steps and one wait (block_until_ready, torch.cuda.synchronize), "
                  "median of the rounds; every method alike"}
    return {"meta": meta, "rows": [rows[m] for m in METHODS if m in rows]}


def _describe_error(exc: Exception) -> str:
    """The exception in one line, and its place (the last frame), for the row's ``error``."""
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" at {Path(frame[0].filename).name}:{frame[0].lineno}" if frame else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"[:500]


def format_jax_train_table(result: dict) -> str:
    """A line naming the run, then one line per method: tokens/s, ms per step, MFU, ratio to the PyTorch
    step, the logits check, the first step's seconds and the loss before and after."""
    meta, rows = result["meta"], result["rows"]
    config, train = meta["model_config"], meta["train_config"]
    lines = [f"jax-train: preset {meta['preset']} ({config['n_layers']} layers, d_model {config['d_model']}, "
             f"{config['num_experts']} experts top-{config['top_k']}), {train['batch_size']} x {train['seq_len']} "
             f"tokens per step, {meta['dtype']}; {meta['gpu']}, jax {meta['jax']}, torch {meta['torch']}, "
             f"commit {meta['commit']}; median of {meta['rounds']} rounds of {meta['steps']} steps",
             f"{'method':<26}{'tokens/s':>12}{'ms/step':>10}{'MFU':>7}{'vs torch':>10}{'logits err':>12}"
             f"{'1st step s':>12}{'loss':>15}  attention"]
    for row in rows:
        label = LABELS.get(row["method"], row["method"])
        if row["error"]:
            lines.append(f"{label:<26}{'ERR':>12}  {row['error']}")
            continue
        speed = "FAIL" if row["failed"] else f"{row['tokens_per_s']:,.0f}"
        mfu = "-" if row["mfu"] is None else f"{row['mfu']:.0%}"
        vs = "-" if row["ratio_to_dropless"] is None else f"{row['ratio_to_dropless']:.2f}"
        losses = f"{row['first_loss']:.3f}->{row['loss']:.3f}"
        lines.append(f"{label:<26}{speed:>12}{row['ms']:>10.1f}{mfu:>7}{vs:>10}{row['max_rel_err']:>12.2e}"
                     f"{row['first_step_s']:>12.1f}{losses:>15}  {row['attention']}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    """A PNG: tokens/s per method, each bar labelled with its ratio to the PyTorch step. False (nothing
    written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["rows"] if r["tokens_per_s"] is not None]
    fig, ax = plt.subplots(figsize=(6, 3.6), layout="constrained")
    bars = ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color=[f"C{i}" for i in range(len(rows))])
    ax.bar_label(bars, [f"{r['ratio_to_dropless']:.2f}x" if r["ratio_to_dropless"] else "" for r in rows], fontsize=8)
    ax.set_xticks(range(len(rows)), [LABELS.get(r["method"], r["method"]) for r in rows], fontsize=8)
    ax.set_ylabel("training tokens/s")
    ax.grid(axis="y", alpha=0.3)
    meta = result["meta"]
    fig.suptitle(f"training step, preset {meta['preset']}: {meta['gpu']}, commit {meta['commit']}", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

