"""experts_implementation="dropless" in Hugging Face transformers against "eager": whole tiny models."""

from __future__ import annotations

import pytest
import torch
from conftest import REL_TOL, rel_err

transformers = pytest.importorskip("transformers", minversion="5.0")

from dropless.integrations import experts_forward, register_transformers  # noqa: E402
from dropless.nn.moe import MoE  # noqa: E402

VOCAB = 64


def _configs() -> dict[str, transformers.PretrainedConfig]:
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    return {
        "mixtral": transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                              **common),
        "qwen3_moe": transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=24, num_experts=8,
                                                 num_experts_per_tok=3, norm_topk_prob=True, head_dim=8, **common),
        "gpt_oss": transformers.GptOssConfig(intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
                                             head_dim=8, **common),
        "deepseek_v3": transformers.DeepseekV3Config(
            intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, **(common | {"num_key_value_heads": 4})),
    }


CONFIGS = _configs()


def _model(name: str, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]).float().to(device)
    with torch.no_grad():  # random, not the near-zero init, so every expert matters
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _run(model, ids, implementation):
    model.set_experts_implementation(implementation)
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_models_match_eager(backend, name):
    _, device = backend
    register_transformers()
    model = _model(name, device)
    ids = torch.randint(0, VOCAB, (2, 7), device=device)
    ref_logits, ref_grads = _run(model, ids, "eager")
    logits, grads = _run(model, ids, "dropless")
    tol = REL_TOL[torch.float32]
    assert rel_err(logits, ref_logits) <= tol
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        assert rel_err(grads[n], ref_grads[n]) <= tol, n


def test_sentinel_expert_ids_contribute_nothing(backend):
    _, device = backend
    model = _model("mixtral", device)
    experts = model.model.layers[0].mlp.experts
    E = experts.num_experts
    x = torch.randn(6, 32, device=device)
    ids = torch.tensor([[0, E], [1, 2], [E + 3, 3], [2, 0], [E, E], [3, 1]], device=device)
    weights = torch.rand(6, 2, device=device)
    y = experts_forward(experts, x, ids, weights)
    valid = ids < E
    expected = experts_forward(experts, x, torch.where(valid, ids, 0), torch.where(valid, weights, 0.0))
    torch.testing.assert_close(y, expected)
    assert torch.equal(y[4], torch.zeros(32, device=device))


@pytest.mark.parametrize("name,layer", [("mixtral", 0), ("qwen3_moe", 1), ("deepseek_v3", 1)])
def test_moe_from_hf_block(backend, name, layer):
    _, device = backend
    model = _model(name, device)
    model.set_experts_implementation("eager")
    block = model.model.layers[layer].mlp
    with torch.no_grad():
        if hasattr(block.gate, "e_score_correction_bias"):
            block.gate.e_score_correction_bias.normal_(0, 0.1)
    moe = MoE.from_hf(block)
    x = torch.randn(2, 5, 32, device=device, requires_grad=True)
    ref = block(x)
    ref.square().mean().backward()
    ref_grad = x.grad.clone()
    x.grad = None
    y = moe(x)
    y.square().mean().backward()
    tol = REL_TOL[torch.float32]
    assert rel_err(y, ref) <= tol
    assert rel_err(x.grad, ref_grad) <= tol


def test_moe_from_hf_rejects_custom_gates():
    block = _model("gpt_oss", torch.device("cpu")).model.layers[0].mlp
    with pytest.raises(ValueError, match="GptOss"):
        MoE.from_hf(block)


def test_moe_from_hf_rejects_unknown_routers():
    config = transformers.DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, max_position_embeddings=64)
    block = transformers.AutoModelForCausalLM.from_config(config).model.layers[1].mlp
    with pytest.raises(ValueError, match="DeepseekV2TopkRouter"):
        MoE.from_hf(block)
