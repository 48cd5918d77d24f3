"""The training loop of ``dropless train``.

Each step: a batch of random windows, the forward (bf16 autocast on a GPU), cross-entropy plus the
routers' auxiliary losses, backward, gradient clipping, AdamW at the scheduled learning rate, and the
expert-bias update for bias-balanced models. Losses and expert loads pile up on the device and are read
every ``log_every`` steps only, so the steps in between never wait for the host. With ``cuda_graph`` the
step is captured in a CUDA graph after a few eager ones and replayed (``captured_step.py``).
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from dropless.parallel import expert_data_parallel
from dropless.train import distributed, expert_parallel
from dropless.train.captured_step import CapturedStep
from dropless.train.checkpoint import CHECKPOINT_NAME, read_checkpoint, restore_optimizer_and_rng, save_checkpoint
from dropless.train.data import BatchSampler, Corpus
from dropless.train.distributed import Ranks
from dropless.train.errors import TrainError
from dropless.train.flops import model_flops_utilization
from dropless.train.model import MoELanguageModel, parameter_counts
from dropless.train.optim import lr_at, make_optimizer
from dropless.train.presets import RUN_CONTROL_FIELDS, ModelConfig, TrainConfig, as_dict, differences
from dropless.train.report import load_balance, plot_expert_load, plot_loss_curve, write_summary

# The held-out batches are the same at every evaluation: drawn from a generator seeded afresh.
_HELD_OUT_SEED_OFFSET = 1_000_003


def _check_cuda_graph(device: torch.device, ranks: Ranks) -> None:
    """TrainError unless a captured step can run here: one process on a GPU."""
    if ranks.world_size > 1:
        raise TrainError(f"--cuda-graph runs one process; this run has {ranks.world_size} (drop torchrun, or "
                         "--cuda-graph)")
    if device.type != "cuda":
        raise TrainError(f"--cuda-graph captures the step in a CUDA graph and needs a GPU; the device is {device}")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (fp32 scalar) of ``logits [B, T, V]`` against ``targets`` int64 ``[B, T]``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def device_name(device: torch.device) -> str:
    """``NVIDIA H100 80GB HBM3`` on a GPU, ``cpu (N threads)`` on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads > 1 else ''})"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Interval:
    """Sums over the steps since the last log point, kept on the device."""

    device: torch.device
    n_layers: int
    num_experts: int
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.losses = torch.zeros(2, device=self.device)
        self.load = torch.zeros(self.n_layers, self.num_experts, dtype=torch.int64, device=self.device)

    def add(self, loss: torch.Tensor, aux_loss: torch.Tensor, load: torch.Tensor) -> None:
        self.losses += torch.stack([loss, aux_loss])
        self.load += load
        self.steps += 1


class Trainer:
    """One training run of a ``MoELanguageModel``, from scratch or resumed from ``out_dir``'s checkpoint.

    ``run()`` trains to ``train_config.steps`` (or an earlier step), writing to ``out_dir`` the
    checkpoint, ``loss.png``, ``expert-load.png`` and ``summary.json`` (rank 0 only), and returns the
    summary. Under torchrun each rank trains a DDP replica on its own batches; with ``ep`` > 1 the
    MoE layers' experts are sharded over groups of ``ep`` ranks (``expert_parallel.py``) and the rest
    is replicated, and checkpoints still hold the whole model.
    """

    def __init__(self, preset: str, model_config: ModelConfig, train_config: TrainConfig, corpus: Corpus,
                 out_dir: Path, device: torch.device, ranks: Ranks = Ranks(), *, resume: bool = False,
                 compile: bool = False, progress: bool = True, ep: int = 1, ep_backend: str = "nccl",
                 cuda_graph: bool = False) -> None:
        self.preset = preset
        self.config = train_config
        self.corpus = corpus
        self.out_dir = Path(out_dir)
        self.device = device
        self.ranks = ranks
        self.progress = progress
        self.ep = ep
        if ep > 1 and ranks.world_size == 1:
            raise TrainError(f"--ep {ep} needs several processes (torchrun --nproc-per-node N, N a multiple of {ep})")
        if cuda_graph:
            _check_cuda_graph(device, ranks)
        # A checkpoint of another run is refused before anything is allocated.
        checkpoint = read_checkpoint(self.checkpoint_path) if resume else None
        if checkpoint is not None:
            self._check_resumable(checkpoint.meta, model_config)
        torch.manual_seed(train_config.seed)
        random.seed(train_config.seed)
        self.model = MoELanguageModel(model_config).to(device)
        if checkpoint is not None:
            self.model.load_state_dict(checkpoint.section("model"))
        if ep > 1:
            expert_parallel.shard_experts(self.model, expert_parallel.ep_group(ep, ranks.world_size,
                                                                               model_config.num_experts), ep_backend)
        self.optimizer = make_optimizer(self.model, train_config, device)
        self.sampler = BatchSampler(corpus.train, train_config.batch_size, train_config.seq_len, train_config.seed,
                                    device, ranks.rank, ranks.world_size)
        self.step = 0
        self.history: list[dict] = []
        if checkpoint is not None:
            shard = lambda state: expert_parallel.slice_optimizer_state(self.model, self.optimizer, state)  # noqa: E731
            self.sampler.set_state(restore_optimizer_and_rng(checkpoint, self.optimizer, shard))
            self.step = checkpoint.meta["step"]
            self.history = checkpoint.meta["history"]
        if ep > 1:
            self.train_model = expert_data_parallel(self.model, device_ids=[device] if device.type == "cuda" else None)
        else:
            self.train_model = distributed.data_parallel(self.model, ranks, device)
        if compile:
            self.train_model = torch.compile(self.train_model)
        # A captured step must not keep autocast's casts of the weights from one replay to the next.
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not cuda_graph)
                         if device.type == "cuda" else contextlib.nullcontext())
        self.captured = CapturedStep(self._step, self.optimizer, device) if cuda_graph else None

    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / CHECKPOINT_NAME

    def _check_resumable(self, meta: dict, model_config: ModelConfig) -> None:
        """TrainError naming every setting in which the checkpoint's run differs from this one (the
        run-control settings such as ``steps`` may change)."""
        mismatches = (differences(meta["model_config"], as_dict(model_config))
                      + differences(meta["train_config"], as_dict(self.config), ignore=RUN_CONTROL_FIELDS)
                      + differences({"world_size": meta["world_size"], "data": meta["data"]["fingerprint"]},
                                    {"world_size": self.ranks.world_size, "data": self.corpus.fingerprint}))
        if mismatches:
            raise TrainError(f"cannot resume from {self.checkpoint_path}: it was written by a run with other "
                             f"settings ({'; '.join(mismatches)})")

    def describe(self) -> str:
        """Three lines on what is about to train, on what, and where it writes."""
        config = self.model.config
        total, active, _ = parameter_counts(config)
        tokens = self.config.batch_size * self.config.seq_len * self.ranks.world_size
        where = device_name(self.device) + (f" x {self.ranks.world_size} ranks" if self.ranks.world_size > 1 else "")
        start = f", resuming at step {self.step}" if self.step else ""
        return (f"dropless train: preset {self.preset}, {total / 1e6:.1f}M parameters ({active / 1e6:.1f}M active), "
                f"{config.n_layers} layers, {config.num_experts} experts top-{config.top_k}, on {where}{start}\n"
                f"data: {self.corpus.name}, {self.corpus.train.numel():,} bytes to train on, "
                f"{self.corpus.held_out.numel():,} held out; {tokens:,} tokens per step, "
                f"{self.config.steps} steps\n"
                f"writing to {self.out_dir}"
                + (", over the checkpoint of an earlier run there (--resume continues it instead)"
                   if not self.step and self.checkpoint_path.exists() else ""))

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step; returns the LM loss and auxiliary loss (fp32 scalars) and the expert load
        (int64 ``[n_layers, E]``), on the device. No host sync. With ``cuda_graph``, after the warm-up
        steps, a replay of the captured step (its outputs are overwritten by the next)."""
        self.train_model.train()
        inputs, targets = self.sampler.next_batch()
        lr = lr_at(self.step, self.config)
        if self.captured is not None:
            outputs = self.captured(inputs, targets, lr)
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            outputs = self._step(inputs, targets)
        self.step += 1
        return outputs

    def _step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward, backward, clipping, the optimizer and the expert bias at the groups' learning rates."""
        with self.autocast:
            logits = self.train_model(inputs)
        loss = lm_loss(logits, targets)
        aux_loss = self.model.aux_loss()
        (loss + aux_loss).backward()
        if self.ep > 1:
            expert_parallel.clip_grad_norm(self.model, self.config.grad_clip)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.model.config.expert_bias:
            for moe in self.model.moe_layers():
                distributed.sum_across_ranks(moe.router.load_since_update)
            self.model.update_expert_bias()
        return loss.detach(), aux_loss.detach(), self.model.expert_load()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over ``eval_batches`` batches of held-out text (the same ones every time), all ranks."""
        self.model.eval()
        sampler = BatchSampler(self.corpus.held_out, self.config.batch_size, self.config.seq_len,
                               self.config.seed + _HELD_OUT_SEED_OFFSET, self.device, self.ranks.rank,
                               self.ranks.world_size)
        total = torch.zeros((), device=self.device)
        for _ in range(self.config.eval_batches):
            inputs, targets = sampler.next_batch()
            with self.autocast:
                total += lm_loss(self.model(inputs), targets)
        held_out = distributed.sum_across_ranks(total).item()  # sync-ok: evaluation, every eval_every steps
        return held_out / (self.config.eval_batches * self.ranks.world_size)

    def _log(self, interval: _Interval) -> dict:
        """Read the interval's sums (the one host sync of a log point) into a history entry."""
        losses = distributed.sum_across_ranks(interval.losses) / (interval.steps * self.ranks.world_size)
        load = distributed.sum_across_ranks(interval.load).tolist()  # sync-ok: a log point
        _synchronize(self.device)
        seconds = time.perf_counter() - interval.started
        tokens = interval.steps * self.config.batch_size * self.config.seq_len * self.ranks.world_size
        loss, aux_loss = losses.tolist()  # sync-ok: a log point
        entry = {"step": self.step, "loss": loss, "aux_loss": aux_loss, "lr": lr_at(self.step - 1, self.config),
                 "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                 "load": load, "load_balance": load_balance(load)}
        self.history.append(entry)
        return entry

    def run(self, until: int | None = None) -> dict:
        """Train to step ``until`` (default: the config's ``steps``), save, write the report; returns the summary."""
        from tqdm import tqdm

        end = self.config.steps if until is None else min(until, self.config.steps)
        config = self.model.config
        session: list[dict] = []
        started = time.perf_counter()
        report = self.progress and self.ranks.is_main
        # A progress bar on a terminal; in a log (no terminal) a line at every log point instead.
        bar = tqdm(total=self.config.steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=not (report and sys.stderr.isatty()))
        interval = _Interval(self.device, config.n_layers, config.num_experts)
        while self.step < end:
            interval.add(*self.train_step())
            bar.update(1)
            # The first step is logged alone: the curve starts at the untrained loss, and the one-off
            # costs of a first step (compilation, kernel tuning) stay out of the throughput.
            if self.step % self.config.log_every and self.step not in (1, end):
                continue
            entry = self._log(interval)
            session.append(entry)
            if self.step % self.config.eval_every == 0 or self.step == end:
                entry["held_out_loss"] = self.evaluate()
            if self.step % self.config.save_every == 0 and self.step != end:
                self.save()
            if report and bar.disable:
                print(f"step {self.step}/{self.config.steps} | {self._postfix(entry)}", flush=True)
            bar.set_postfix_str(self._postfix(entry))
            interval = _Interval(self.device, config.n_layers, config.num_experts)
        bar.close()
        experts = frozenset(id(p) for p, _ in expert_parallel.expert_parameters(self.model).values())
        distributed.check_replicas_identical(self.model, experts)
        if session:
            self.save()
        return self._finish(session, time.perf_counter() - started)

    def _last_held_out_loss(self) -> float | None:
        return next((h["held_out_loss"] for h in reversed(self.history) if "held_out_loss" in h), None)

    def _postfix(self, entry: dict) -> str:
        held_out = self._last_held_out_loss()
        return (f"loss {entry['loss']:.3f}" + (f" | held-out {held_out:.3f}" if held_out is not None else "")
                + f" | {entry['tokens_per_s'] / 1e3:.1f}k tok/s | load max/mean {entry['load_balance']:.2f}")

    def save(self) -> None:
        """Write the checkpoint of the current step (rank 0; with ``ep`` > 1 every rank first helps gather
        the experts' tensors whole)."""
        states = expert_parallel.full_state(self.model, self.optimizer) if self.ep > 1 else None
        if not self.ranks.is_main:
            return
        meta = {"preset": self.preset, "model_config": as_dict(self.model.config),
                "train_config": as_dict(self.config), "world_size": self.ranks.world_size, "ep": self.ep,
                "data": {"name": self.corpus.name, "fingerprint": self.corpus.fingerprint, "bytes": self.corpus.size},
                "step": self.step, "history": self.history}
        save_checkpoint(self.checkpoint_path, self.model, self.optimizer, self.sampler.get_state(), meta, states)

    def _finish(self, session: list[dict], wall_s: float) -> dict:
        """The summary of this session (its first interval, with compilation and tuning, left out of the
        throughput when there are others), and the report files (rank 0)."""
        if not self.history:
            raise TrainError(f"nothing to do: the run is at step {self.step} of {self.config.steps}")
        steady = session[1:] or session or self.history[-1:]
        tokens_per_s = sum(h["tokens"] for h in steady) / sum(h["seconds"] for h in steady)
        last = self.history[-1]
        total, active, _ = parameter_counts(self.model.config)
        name = device_name(self.device)
        summary = {
            "preset": self.preset, "device": name, "world_size": self.ranks.world_size, "step": self.step,
            "steps": self.config.steps, "wall_s": wall_s, "tokens_per_s": tokens_per_s,
            "tokens_seen": sum(h["tokens"] for h in self.history),
            "mfu": (model_flops_utilization(tokens_per_s, self.model.config, self.config.seq_len, name,
                                            self.ranks.world_size) if self.device.type == "cuda" else None),
            "first_loss": self.history[0]["loss"], "loss": last["loss"], "held_out_loss": self._last_held_out_loss(),
            "load_balance": last["load_balance"], "parameters": total, "active_parameters": active,
            "data": self.corpus.name, "model_config": as_dict(self.model.config),
            "train_config": as_dict(self.config), "cuda_graph": self.captured is not None, "files": [],
            "history": self.history,
        }
        if self.ranks.is_main:
            title = (f"dropless train --preset {self.preset}: {name}"
                     + (f" x {self.ranks.world_size}" if self.ranks.world_size > 1 else "")
                     + f", {self.step} steps of {self.config.batch_size * self.ranks.world_size} x "
                     f"{self.config.seq_len} bytes, {self.corpus.name}")
            files = [self.checkpoint_path]
            for filename, plot in (("loss.png", plot_loss_curve), ("expert-load.png", plot_expert_load)):
                if plot(self.history, self.out_dir / filename, title):
                    files.append(self.out_dir / filename)
            files.append(self.out_dir / "summary.json")
            summary["files"] = [str(f) for f in files]
            write_summary(summary, self.out_dir / "summary.json")
        return summary
