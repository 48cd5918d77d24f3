"""The autotuner's rules: which problems are timed, and what the others run."""

from __future__ import annotations

import pytest
import torch

from dropless.kernels.autotune import MIN_TUNED_FLOPS, Autotuner
from dropless.kernels.config import GemmConfig

CANDIDATES = [GemmConfig(128, 256, 64), GemmConfig(64, 128, 32)]


def _tuner() -> Autotuner:
    return Autotuner("test", CANDIDATES, default=CANDIDATES[0], small_default=CANDIDATES[1],
                     interpreter_config=GemmConfig(32, 32, 32))


def _never(config: GemmConfig) -> None:
    raise AssertionError(f"timed {config} for a problem that takes the default")


def test_small_problems_take_the_default_untimed():
    tuner = _tuner()
    cuda = torch.device("cuda")
    assert tuner.choose(("k", 1), cuda, 2, MIN_TUNED_FLOPS - 1, _never) == CANDIDATES[0]
    assert tuner.choose(("k", 2), cuda, 4, MIN_TUNED_FLOPS // 7, _never) == CANDIDATES[1]
    assert tuner.cache == {}


def test_autotune_off_takes_the_default(monkeypatch):
    monkeypatch.setenv("DROPLESS_AUTOTUNE", "0")
    assert _tuner().choose(("k", 3), torch.device("cuda"), 2, 2**40, _never) == CANDIDATES[0]


@pytest.fixture
def timings(monkeypatch) -> dict:
    """Autotuning on, with each timing read from the returned dict by what the timed call returns."""
    import dropless.kernels.autotune as autotune

    table = {}
    monkeypatch.setattr(autotune, "gpu_time_ms", lambda fn, device: table[fn()])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("DROPLESS_AUTOTUNE", "1")
    return table


def test_the_default_stays_unless_clearly_beaten(timings):
    cuda = torch.device("cuda")
    default, other = CANDIDATES
    timings.update({default: 1.0, other: 0.98})  # 2% faster: within the margin
    assert _tuner().choose(("k", 4), cuda, 2, 2**40, lambda config: config) == default
    timings.update({default: 1.0, other: 0.9})  # 10% faster: replaces the default
    assert _tuner().choose(("k", 5), cuda, 2, 2**40, lambda config: config) == other
    timings.update({default: 0.98, other: 1.0})  # the default is faster
    assert _tuner().choose(("k", 6), cuda, 2, 2**40, lambda config: config) == default


def test_a_second_routing_counts_as_much_as_the_first(timings):
    """With ``also`` (the same product under another routing), each candidate's times, as fractions of the
    best under the same routing, are added: a config faster on the first call but slow on the other
    routing loses to one good on both, even where the first call's product takes ten times longer."""
    cuda = torch.device("cuda")
    default, other = CANDIDATES
    run, also = (lambda config: config), (lambda config: ("also", config))
    timings.update({default: 1.0, other: 0.8, ("also", default): 0.3, ("also", other): 0.9})
    assert _tuner().choose(("k", 7), cuda, 2, 2**40, run) == other
    assert _tuner().choose(("k", 8), cuda, 2, 2**40, run, also) == default
    timings.update({("also", default): 0.9, ("also", other): 0.3})
    assert _tuner().choose(("k", 9), cuda, 2, 2**40, run, also) == other
    # 5% slower on the long first call, 20% faster on the short other one: a plain sum of times would
    # take the other config (10.7 against 11.0).
    timings.update({default: 10.0, other: 9.5, ("also", default): 1.0, ("also", other): 1.2})
    assert _tuner().choose(("k", 10), cuda, 2, 2**40, run, also) == default


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_time_leaves_out_the_host():
    """A call whose host spends 400 us before launching a ~50 us kernel times as its kernel: a back-to-back
    timing would read the host's 400."""
    import time

    from dropless.kernels.autotune import _cycles_per_us, gpu_time_ms

    device = torch.device("cuda")
    kernel_us = 50.0
    cycles = int(kernel_us * _cycles_per_us(device))

    def slow_host() -> None:
        time.sleep(400e-6)
        torch.cuda._sleep(cycles)

    ms = gpu_time_ms(slow_host, device)
    assert 0.8 * kernel_us <= 1e3 * ms <= 2.0 * kernel_us, ms
