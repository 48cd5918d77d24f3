"""dropless train's model and its budget: parameter counts, causality, memory estimate, MFU, schedule."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from dropless.train.errors import TrainError
from dropless.train.flops import model_flops_utilization, peak_bf16_flops, training_flops_per_token
from dropless.train.memory import GIB, activation_bytes_per_token, check_fits, estimate_training_memory
from dropless.train.model import MoELanguageModel, parameter_counts
from dropless.train.optim import lr_at
from dropless.train.presets import PRESETS, ModelConfig


def random_config() -> ModelConfig:
    n_heads = random.choice([1, 2, 4])
    num_experts = random.randint(1, 8)
    return ModelConfig(d_model=n_heads * 2 * random.randint(2, 8), n_layers=random.randint(1, 3), n_heads=n_heads,
                       num_experts=num_experts, top_k=random.randint(1, num_experts), d_ff=random.randint(4, 40),
                       expert_bias=random.random() < 0.5)


@pytest.mark.parametrize("name", [*PRESETS, "random"])
def test_parameter_counts_match_the_model(name):
    config = PRESETS[name].model if name in PRESETS else random_config()
    with torch.device("meta"):
        model = MoELanguageModel(config)
    total, active, embedding = parameter_counts(config)
    assert total == sum(p.numel() for p in model.parameters())
    assert embedding == model.embedding.weight.numel()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts_" in n)
    assert active == total - embedding - experts * (config.num_experts - config.top_k) // config.num_experts


def test_a_token_sees_only_the_tokens_before_it():
    config = random_config()
    model = MoELanguageModel(config).eval()
    T = random.randint(4, 20)
    tokens = torch.randint(0, 256, (2, T))
    changed = tokens.clone()
    t = random.randrange(1, T)
    changed[:, t] = (changed[:, t] + 1) % 256
    with torch.no_grad():
        logits, logits_changed = model(tokens), model(changed)
    assert logits.shape == (2, T, 256)
    assert torch.equal(logits[:, :t], logits_changed[:, :t])
    assert not torch.equal(logits[:, t:], logits_changed[:, t:])


def test_aux_loss_and_expert_load_of_a_forward():
    config = random_config()
    model = MoELanguageModel(config)
    B, T = 3, random.randint(2, 9)
    model(torch.randint(0, 256, (B, T)))
    load = model.expert_load()
    assert load.shape == (config.n_layers, config.num_experts)
    assert load.sum(1).tolist() == [B * T * config.top_k] * config.n_layers
    assert model.aux_loss().dtype == torch.float32 and model.aux_loss().item() >= 0


def saved_bytes(model: MoELanguageModel, tokens: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd saves in a bf16-autocast forward of ``tokens``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    return sum(storages.values())


def test_activation_estimate_matches_what_autograd_saves():
    config = dataclasses.replace(random_config(), n_layers=random.randint(2, 4))
    model = MoELanguageModel(config)
    T = random.randint(32, 64)
    # The bytes that grow with the tokens: weights and their bf16 copies cancel out.
    per_token = (saved_bytes(model, torch.randint(0, 256, (4, T)))
                 - saved_bytes(model, torch.randint(0, 256, (2, T)))) / (2 * T * config.n_layers)
    assert per_token == pytest.approx(activation_bytes_per_token(config), rel=0.25)


def test_memory_estimate_grows_with_the_run():
    config = random_config()
    small = estimate_training_memory(config, 4, 64)
    assert estimate_training_memory(config, 8, 64).activations > small.activations
    assert estimate_training_memory(config, 4, 128).activations > small.activations
    deeper = dataclasses.replace(config, n_layers=config.n_layers + 1)
    assert estimate_training_memory(deeper, 4, 64).total > small.total
    assert small.states == 18 * parameter_counts(config)[0]


def test_check_fits_with_room_to_spare():
    preset = PRESETS[random.choice(list(PRESETS))]
    need = estimate_training_memory(preset.model, preset.train.batch_size, preset.train.seq_len).total
    check_fits(preset.name, preset.model, preset.train.batch_size, preset.train.seq_len, need, "a GPU")


def test_check_fits_refuses_and_suggests_what_fits():
    preset = PRESETS["medium"]
    B, T = preset.train.batch_size, preset.train.seq_len
    need = estimate_training_memory(preset.model, B, T).total
    free = int(need * random.uniform(0.4, 0.9))
    with pytest.raises(TrainError) as error:
        check_fits(preset.name, preset.model, B, T, free, "NVIDIA Test GPU")
    message = str(error.value)
    assert "preset 'medium'" in message and "NVIDIA Test GPU" in message
    assert f"needs about {need / GIB:.1f} GiB" in message and f"{free / GIB:.1f} GiB free" in message
    suggested = int(message.split("--batch-size ")[1].split()[0])
    assert estimate_training_memory(preset.model, suggested, T).total <= free
    assert estimate_training_memory(preset.model, suggested + 1, T).total > free
    assert "--preset small" in message or estimate_training_memory(PRESETS["small"].model, B, T).total > free


def test_check_fits_with_nothing_that_fits():
    preset = PRESETS["small"]
    with pytest.raises(TrainError, match="try a smaller preset or --seq-len"):
        check_fits("small", preset.model, 8, 1024, GIB // 2, "a small GPU")


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                            ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                            ("NVIDIA GeForce RTX 4090", None)])
def test_peak_flops_of_known_gpus(name, peak):
    assert peak_bf16_flops(name) == peak


def test_mfu_counts_active_parameters_and_attention():
    config = random_config()
    T = random.randint(16, 2048)
    _, active, _ = parameter_counts(config)
    per_token = training_flops_per_token(config, T)
    assert per_token == 6 * active + 12 * config.n_layers * config.d_model * T
    tokens_per_s = random.uniform(1e3, 1e6)
    mfu = model_flops_utilization(tokens_per_s, config, T, "NVIDIA H100 80GB HBM3", num_gpus=2)
    assert mfu == pytest.approx(tokens_per_s * per_token / (2 * 989e12))
    assert model_flops_utilization(tokens_per_s, config, T, "some GPU") is None


def test_learning_rate_schedule():
    run = dataclasses.replace(PRESETS["tiny"].train, steps=random.randint(50, 500), warmup_steps=random.randint(1, 20))
    lrs = [lr_at(step, run) for step in range(run.steps)]
    warmup = lrs[:run.warmup_steps]
    assert warmup == sorted(warmup) and lrs[run.warmup_steps - 1] == pytest.approx(run.lr)
    assert lrs[0] == pytest.approx(run.lr / run.warmup_steps)
    decay = lrs[run.warmup_steps - 1:]
    assert decay == sorted(decay, reverse=True)
    assert lr_at(run.steps, run) == pytest.approx(run.min_lr_ratio * run.lr)
    assert all(0 < lr <= run.lr * (1 + 1e-12) for lr in lrs)
    assert all(lr >= run.min_lr_ratio * run.lr * (1 - 1e-12) for lr in decay)
