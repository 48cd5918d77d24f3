"""dropless train's loop: a tiny model overfits a tiny text, checkpoints round-trip, resuming is exact,
two torchrun ranks stay identical."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dropless.train import captured_step
from dropless.train.checkpoint import load_model, read_checkpoint
from dropless.train.data import encode, load_corpus
from dropless.train.distributed import Ranks
from dropless.train.errors import TrainError
from dropless.train.generate import sample
from dropless.train.loop import Trainer
from dropless.train.presets import PRESETS, ModelConfig, TrainConfig

WORDS = ("expert", "router", "token", "grouped", "gemm", "offsets", "dropless", "layer", "tile", "kernel",
         "sort", "gather", "scatter", "bias", "balance", "loss")

# A model of a few thousand parameters: steps take milliseconds on the CPU.
SMALL_MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, num_experts=4, top_k=2, d_ff=32)
SMALL_RUN = TrainConfig(steps=8, batch_size=4, seq_len=16, lr=3e-3, warmup_steps=2, log_every=3, eval_every=4,
                        eval_batches=2, save_every=5)


def random_text(path: Path, words: int) -> Path:
    """A text of ``words`` random words, fresh for each test."""
    path.write_text(" ".join(random.choice(WORDS) for _ in range(words)) + "\n")
    return path


def make_trainer(tmp_path: Path, out: str, model: ModelConfig = SMALL_MODEL, run: TrainConfig = SMALL_RUN,
                 device: str = "cpu", **kwargs) -> Trainer:
    corpus = load_corpus(tmp_path / "text.txt", run.seq_len)
    return Trainer("test", model, run, corpus, tmp_path / out, torch.device(device), progress=False, **kwargs)


def state_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Everything a step changes: parameters, buffers, AdamW's moments and step counts, the sampler."""
    state = {f"model.{k}": v for k, v in trainer.model.state_dict().items()}
    for index, param_state in trainer.optimizer.state_dict()["state"].items():
        state |= {f"optimizer.{index}.{k}": v for k, v in param_state.items()}
    return state | {"sampler": trainer.sampler.get_state()}


def assert_same_state(a: Trainer, b: Trainer) -> None:
    state_a, state_b = state_of(a), state_of(b)
    assert state_a.keys() == state_b.keys()
    differing = [k for k in state_a if not torch.equal(state_a[k], state_b[k])]
    assert not differing, f"{len(differing)} tensors differ, e.g. {differing[:3]}"


def test_tiny_preset_overfits_a_tiny_text(tmp_path):
    random_text(tmp_path / "text.txt", 60)
    preset = PRESETS["tiny"]
    run = dataclasses.replace(preset.train, steps=40, batch_size=8, seq_len=32, warmup_steps=5, log_every=5,
                              eval_every=40, eval_batches=1, save_every=40)
    summary = make_trainer(tmp_path, "out", preset.model, run).run()
    history = summary["history"]
    assert history[0]["step"] == 1 and history[-1]["step"] == 40
    assert summary["first_loss"] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.5)
    assert summary["loss"] < 0.5 * summary["first_loss"], [round(h["loss"], 3) for h in history]
    assert all(h["load_balance"] >= 1.0 for h in history)
    assert summary["tokens_seen"] == 40 * 8 * 32
    for name in ("checkpoint.safetensors", "loss.png", "expert-load.png", "summary.json"):
        assert (tmp_path / "out" / name).is_file(), name
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["step"] == 40


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_on_the_gpu_overfits(tmp_path):
    random_text(tmp_path / "text.txt", 60)
    run = dataclasses.replace(SMALL_RUN, steps=60, batch_size=8, seq_len=32, warmup_steps=5, log_every=10,
                              eval_every=60, save_every=60)
    summary = make_trainer(tmp_path, "out", dataclasses.replace(SMALL_MODEL, d_model=64, d_ff=64), run,
                           device="cuda").run()
    assert summary["loss"] < 0.5 * summary["first_loss"], [round(h["loss"], 3) for h in summary["history"]]


@pytest.mark.parametrize("kwargs, message", [
    ({"ranks": Ranks(world_size=2)}, "runs one process; this run has 2"),
    ({}, "needs a GPU; the device is cpu"),
])
def test_cuda_graph_refuses_what_it_cannot_capture(tmp_path, kwargs, message):
    random_text(tmp_path / "text.txt", 60)
    with pytest.raises(TrainError, match=message):
        make_trainer(tmp_path, "out", cuda_graph=True, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_step_trains_like_the_eager_one_and_resumes(tmp_path):
    """``cuda_graph``: three eager steps, then the step captured and replayed; the losses follow the eager
    run's, and a run stopped after a replayed step (its checkpoint holding the device learning rates as
    numbers) resumes, captures again and ends where the uninterrupted one does, bit for bit."""
    random_text(tmp_path / "text.txt", 300)
    run = dataclasses.replace(SMALL_RUN, steps=10, log_every=1)
    eager = make_trainer(tmp_path, "eager", run=run, device="cuda").run()
    straight = make_trainer(tmp_path, "graph", run=run, device="cuda", cuda_graph=True)
    summary = straight.run()
    assert straight.captured.captured
    assert [h["step"] for h in summary["history"]] == list(range(1, 11))
    for a, b in zip(eager["history"], summary["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
    interrupted = make_trainer(tmp_path, "resumed", run=run, device="cuda", cuda_graph=True)
    interrupted.run(until=6)
    assert interrupted.captured.captured
    resumed = make_trainer(tmp_path, "resumed", run=run, device="cuda", cuda_graph=True, resume=True)
    assert resumed.step == 6 and resumed.optimizer.param_groups[0]["lr"].is_cuda
    resumed.run()
    assert_same_state(resumed, straight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_model_captured_without_compiling_again(tmp_path):
    """``compile`` with ``cuda_graph``: the model compiled in the warm-up steps is the one captured (a
    compilation during the capture raises here), and the losses follow the eager run's."""
    random_text(tmp_path / "text.txt", 300)
    run = dataclasses.replace(SMALL_RUN, steps=8, log_every=1)
    eager = make_trainer(tmp_path, "eager", run=run, device="cuda").run()
    trainer = make_trainer(tmp_path, "graph", run=run, device="cuda", cuda_graph=True, compile=True)
    trainer.run(until=captured_step.WARMUP_STEPS)
    with torch._dynamo.config.patch(error_on_recompile=True):
        summary = trainer.run()
    assert trainer.captured.captured
    for a, b in zip(eager["history"], summary["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("expert_bias", [False, True], ids=["aux_loss", "expert_bias"])
def test_resume_continues_bit_for_bit(tmp_path, expert_bias, device):
    random_text(tmp_path / "text.txt", 300)
    model = dataclasses.replace(SMALL_MODEL, expert_bias=expert_bias)
    straight = make_trainer(tmp_path, "straight", model, device=device)
    straight.run()
    stop = random.randint(1, SMALL_RUN.steps - 1)
    interrupted = make_trainer(tmp_path, "resumed", model, device=device)
    interrupted.run(until=stop)
    assert read_checkpoint(interrupted.checkpoint_path).meta["step"] == stop
    resumed = make_trainer(tmp_path, "resumed", model, device=device, resume=True)
    assert resumed.step == stop
    assert_same_state(resumed, interrupted)
    summary = resumed.run()
    assert summary["step"] == SMALL_RUN.steps
    assert_same_state(resumed, straight)
    if expert_bias:
        assert any(moe.router.expert_bias.abs().sum() > 0 for moe in resumed.model.moe_layers())


def test_checkpoint_round_trip(tmp_path):
    random_text(tmp_path / "text.txt", 300)
    trainer = make_trainer(tmp_path, "out")
    trainer.run(until=3)
    model, checkpoint = load_model(trainer.checkpoint_path, torch.device("cpu"))
    assert not model.training
    assert model.config == trainer.model.config
    saved, trained = model.state_dict(), trainer.model.state_dict()
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[k], trained[k]) for k in saved)
    meta = checkpoint.meta
    assert meta["step"] == 3 and meta["preset"] == "test" and meta["world_size"] == 1
    assert meta["train_config"] == dataclasses.asdict(SMALL_RUN)
    assert [h["step"] for h in meta["history"]] == [1, 3]
    assert torch.equal(checkpoint.tensors["rng.sampler"], trainer.sampler.get_state())
    optimizer_state = trainer.optimizer.state_dict()["state"]
    for index, param_state in optimizer_state.items():
        for name, value in param_state.items():
            assert torch.equal(checkpoint.tensors[f"optimizer.{index}.{name}"], value)


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path):
    random_text(tmp_path / "text.txt", 300)
    make_trainer(tmp_path, "out").run(until=2)
    wider = dataclasses.replace(SMALL_MODEL, d_model=2 * SMALL_MODEL.d_model)
    with pytest.raises(TrainError, match=r"d_model: 32 \(checkpoint\) != 64 \(this run\)"):
        make_trainer(tmp_path, "out", wider, resume=True)
    faster = dataclasses.replace(SMALL_RUN, lr=2 * SMALL_RUN.lr, batch_size=SMALL_RUN.batch_size + 1)
    with pytest.raises(TrainError, match="batch_size: 4 .*; lr: "):
        make_trainer(tmp_path, "out", run=faster, resume=True)
    random_text(tmp_path / "text.txt", 300)
    with pytest.raises(TrainError, match="data: "):
        make_trainer(tmp_path, "out", resume=True)


def test_resume_may_run_longer(tmp_path):
    random_text(tmp_path / "text.txt", 300)
    make_trainer(tmp_path, "out").run()
    longer = dataclasses.replace(SMALL_RUN, steps=SMALL_RUN.steps + 2, log_every=1)
    summary = make_trainer(tmp_path, "out", run=longer, resume=True).run()
    assert summary["step"] == SMALL_RUN.steps + 2
    assert [h["step"] for h in summary["history"]][-2:] == [SMALL_RUN.steps + 1, SMALL_RUN.steps + 2]


def test_resume_without_a_checkpoint(tmp_path):
    random_text(tmp_path / "text.txt", 300)
    with pytest.raises(TrainError, match="no such checkpoint"):
        make_trainer(tmp_path, "nowhere", resume=True)


@pytest.mark.skipif(shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
                    reason="needs torchrun")
def test_torchrun_two_cpu_ranks(tmp_path):
    text = random_text(tmp_path / "text.txt", 400)
    out = tmp_path / "out"
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--master-port", str(random.randint(20000, 60000)), "-m", "dropless",
         "train", "--preset", "tiny", "--device", "cpu", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
         "--data", str(text), "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    # Each rank checks at the end that its replica equals rank 0's; the run fails otherwise.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == 3
    assert summary["tokens_seen"] == 3 * 2 * 2 * 32
    assert read_checkpoint(out / "checkpoint.safetensors").meta["world_size"] == 2
    assert result.stdout.count("trained tiny") == 1  # only rank 0 reports


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generate_continues_a_prompt_by_the_requested_bytes(tmp_path, temperature):
    random_text(tmp_path / "text.txt", 300)
    trainer = make_trainer(tmp_path, "out")
    trainer.run(until=2)
    model, _ = load_model(trainer.checkpoint_path, torch.device("cpu"))
    prompt = encode(random.choice(WORDS) * 3)  # longer than the context of SMALL_RUN.seq_len bytes
    new_tokens = random.randint(1, 30)
    tokens = sample(model, prompt, new_tokens, context=SMALL_RUN.seq_len, temperature=temperature,
                    generator=torch.Generator().manual_seed(random.randrange(2**31)))
    assert tokens.shape == (prompt.numel() + new_tokens,) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:prompt.numel()], prompt.long())
    assert 0 <= int(tokens.min()) and int(tokens.max()) < 256
    if temperature == 0:
        assert torch.equal(sample(model, prompt, new_tokens, context=SMALL_RUN.seq_len, temperature=0), tokens)


@pytest.mark.slow
def test_compiled_model_trains_like_the_eager_one(tmp_path):
    random_text(tmp_path / "text.txt", 300)
    run = dataclasses.replace(SMALL_RUN, steps=4, log_every=1)
    eager = make_trainer(tmp_path, "eager", run=run).run()
    compiled = make_trainer(tmp_path, "compiled", run=run, compile=True).run()
    for a, b in zip(eager["history"], compiled["history"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-2)
