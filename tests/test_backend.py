"""dropless.backend: which implementation runs an op."""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import CUDA, assert_close

import dropless
from dropless import backend


def test_default_is_auto():
    assert dropless.get_backend() == "auto"
    assert backend.use_triton(torch.device("cuda")) is True
    assert backend.use_triton(torch.device("cpu")) is False


@pytest.mark.parametrize("name, cpu, cuda", [("triton", True, True), ("reference", False, False),
                                             ("auto", False, True)])
def test_set_backend(name, cpu, cuda):
    dropless.set_backend(name)
    assert dropless.get_backend() == name
    assert backend.use_triton(torch.device("cpu")) is cpu
    assert backend.use_triton(torch.device("cuda")) is cuda


def test_environment_variable(monkeypatch):
    monkeypatch.setenv("DROPLESS_BACKEND", "reference")
    assert dropless.get_backend() == "reference"
    dropless.set_backend("triton")  # an explicit choice wins over the environment
    assert dropless.get_backend() == "triton"
    monkeypatch.setattr(backend, "_backend", None)
    monkeypatch.setenv("DROPLESS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="DROPLESS_BACKEND"):
        dropless.get_backend()


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        dropless.set_backend("cutlass")
    assert dropless.get_backend() == "auto"


def test_backends_agree_and_reference_never_launches_kernels(monkeypatch):
    """The reference backend runs no kernel; the Triton backend does for every form of grouped_mm (and
    they agree)."""
    forms_module = importlib.import_module("dropless.ops.grouped_forms")
    launches = []

    def recording(name, original):
        return lambda *a, **k: (launches.append(name), original(*a, **k))

    for name in ("run_ragged_m", "run_ragged_k"):
        monkeypatch.setattr(forms_module, name, recording(name, getattr(forms_module, name)))
    device = torch.device("cuda" if CUDA else "cpu")
    x = torch.randn(20, 16, device=device)
    w = torch.randn(2, 16, 8, device=device)
    offsets = torch.tensor([7, 15], dtype=torch.int32, device=device)
    calls = {"ragged_m": (x, w, offsets), "ragged_k": (x.t(), x, offsets), "ragged_n": (w, x[:8], offsets),
             "batched": (w.transpose(1, 2), w, None)}
    dropless.set_backend("reference")
    y_ref = {form: dropless.grouped_mm(*args) for form, args in calls.items()}
    assert not launches
    dropless.set_backend("triton")
    for form, args in calls.items():
        launches.clear()
        y = dropless.grouped_mm(*args)
        assert launches == ["run_ragged_k" if form == "ragged_k" else "run_ragged_m"], form
        assert_close(y, y_ref[form], torch.float32, form)


@pytest.mark.skipif(CUDA, reason="without CUDA and without the interpreter there are no kernels")
def test_triton_backend_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dropless.set_backend("triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dropless.grouped_mm(torch.randn(4, 8), torch.randn(1, 8, 8), torch.tensor([4], dtype=torch.int32))
