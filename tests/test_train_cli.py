"""The dropless command: help, a short run and sampling from its checkpoint, its one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_train import random_text

from dropless.cli import main
from dropless.train.checkpoint import load_model
from dropless.train.presets import PRESETS


def test_module_help_lists_the_commands():
    result = subprocess.run([sys.executable, "-m", "dropless", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "train" in result.stdout and "generate" in result.stdout


@pytest.mark.parametrize("command", ["train", "generate"])
def test_command_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dropless {command}")
    if command == "train":
        assert all(name in out for name in PRESETS) and "torchrun" in out


def test_importing_dropless_leaves_the_trainer_out():
    code = ("import sys, dropless; print(sorted(m for m in ('matplotlib', 'safetensors', 'dropless.train', "
            "'dropless.cli') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_train_then_generate(tmp_path, capsys):
    text = random_text(tmp_path / "text.txt", 200)
    out = tmp_path / "run"
    status = main(["train", "--data", str(text), "--steps", "3", "--batch-size", "2", "--seq-len", "16",
                   "--out", str(out), "--device", "cpu"])
    assert status == 0
    printed = capsys.readouterr().out
    assert "preset tiny" in printed and "trained tiny to step 3" in printed
    for name in ("checkpoint.safetensors", "loss.png", "expert-load.png", "summary.json"):
        assert f"wrote {out / name}" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mfu"] is None and summary["data"] == str(text)
    assert main(["generate", str(out / "checkpoint.safetensors"), "--prompt", "router", "--tokens", "25",
                 "--temperature", "0", "--device", "cpu"]) == 0
    generated = capsys.readouterr().out
    assert generated.startswith("router")


def test_missing_data_file(tmp_path, capsys):
    missing = tmp_path / "nothing.txt"
    assert main(["train", "--data", str(missing), "--device", "cpu", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"--data {missing}: no such file" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("device, message", [("tpu", "not a device PyTorch knows"),
                                             ("meta", "dropless trains on cpu or cuda")])
def test_unknown_device(tmp_path, capsys, device, message):
    assert main(["train", "--device", device, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"--device {device}: {message}" in err


def test_text_too_short(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("expert " * 10)
    assert main(["train", "--data", str(text), "--seq-len", "64", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "too short for --seq-len 64" in capsys.readouterr().err


def test_generate_from_a_missing_checkpoint(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "checkpoint.safetensors"), "--device", "cpu"]) == 2
    assert "no such checkpoint" in capsys.readouterr().err


def test_generate_from_a_file_that_is_no_checkpoint(tmp_path, capsys):
    not_a_checkpoint = random_text(tmp_path / "checkpoint.safetensors", 20)
    assert main(["generate", str(not_a_checkpoint), "--device", "cpu"]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err


def test_resume_with_another_preset_names_the_fields(tmp_path, capsys):
    text = random_text(tmp_path / "text.txt", 200)
    common = ["--data", str(text), "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--out", str(tmp_path / "run"),
              "--device", "cpu"]
    assert main(["train", *common]) == 0
    capsys.readouterr()
    assert main(["train", *common, "--preset", "small", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "d_model: 128 (checkpoint) != 512 (this run)" in err and "n_layers" in err


def test_rejects_a_step_count_below_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--steps", "0"])
    assert exit_info.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("lr, message", [
    ("nan", "must be a positive finite number, got nan"), ("inf", "must be a positive finite number, got inf"),
    ("-1e-3", "must be a positive finite number, got -1e-3"), ("0", "must be a positive finite number, got 0"),
    ("fast", "must be a number, got 'fast'"),
])
def test_rejects_a_bad_learning_rate(lr, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", f"--lr={lr}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --lr: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("where, message", [("under_a_file", "cannot create the folder (Not a directory)"),
                                            ("a_file", "is a file, not a folder")])
def test_out_that_cannot_be_a_folder(where, message, tmp_path, capsys):
    text = random_text(tmp_path / "text.txt", 200)
    out = text / "run" if where == "under_a_file" else text
    assert main(["train", "--data", str(text), "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                 "--out", str(out), "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: --out {out}: {message}\n"
    assert "preset" not in captured.out  # refused before the run starts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_train_then_generate_on_the_gpu(tmp_path, capsys):
    text = random_text(tmp_path / "text.txt", 200)
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", str(text), "--steps", "3", "--batch-size", "2",
                 "--seq-len", "16", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == torch.cuda.get_device_name() and summary["step"] == 3
    capsys.readouterr()
    assert main(["generate", str(out / "checkpoint.safetensors"), "--prompt", "router", "--tokens", "25"]) == 0
    assert capsys.readouterr().out.startswith("router")


def test_cuda_graph_on_the_cpu_is_a_one_line_error(tmp_path, capsys):
    text = random_text(tmp_path / "text.txt", 200)
    assert main(["train", "--cuda-graph", "--data", str(text), "--steps", "2", "--out", str(tmp_path / "run"),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --cuda-graph") and "needs a GPU" in err and len(err.strip().splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_train_cuda_graph_flag_on_the_gpu(tmp_path):
    text = random_text(tmp_path / "text.txt", 200)
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--cuda-graph", "--data", str(text), "--steps", "6",
                 "--batch-size", "2", "--seq-len", "16", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 6 and summary["loss"] < summary["first_loss"]


def test_train_fp8_flag(tmp_path, capsys):
    """``--fp8 rowwise`` trains with FP8 experts, records the recipe in the checkpoint, and a bad recipe
    is refused by the parser."""
    text = random_text(tmp_path / "text.txt", 200)
    out = tmp_path / "run"
    assert main(["train", "--fp8", "rowwise", "--data", str(text), "--steps", "2", "--batch-size", "2",
                 "--seq-len", "16", "--out", str(out), "--device", "cpu"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_config"]["fp8"] == "rowwise"
    assert all(layer.moe.experts_down.recipe.name == "rowwise"
               for layer in load_model(out / "checkpoint.safetensors", torch.device("cpu"))[0].blocks)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["train", "--fp8", "fp4"])
    assert "invalid choice: 'fp4'" in capsys.readouterr().err


def test_train_recompute_activation_flag(tmp_path):
    """``--recompute-activation`` builds every MoE layer with it and records it in the checkpoint."""
    text = random_text(tmp_path / "text.txt", 200)
    out = tmp_path / "run"
    assert main(["train", "--recompute-activation", "--data", str(text), "--steps", "2", "--batch-size", "2",
                 "--seq-len", "16", "--out", str(out), "--device", "cpu"]) == 0
    assert json.loads((out / "summary.json").read_text())["model_config"]["recompute_activation"] is True
    model = load_model(out / "checkpoint.safetensors", torch.device("cpu"))[0]
    assert all(block.moe.recompute_activation for block in model.blocks)
