"""find_moe_layers: exactly the routed sparse blocks of every supported architecture."""

from __future__ import annotations

import pytest
import torch
import transformers

from ompmoe import ARCHITECTURES, UnsupportedModelError, collect_stats, find_moe_layers, supported_model_types
from ompmoe.engine.tiny import TINY_CONFIGS, tiny_model

from reference import ARCH_CASES, ARCH_IDS, make_model

# case -> (indices of the sparse decoder layers, num_experts, top_k, num_groups, topk_group, group_score_topk)
EXPECTED = {
    "qwen3_moe": ([1, 2], 16, 4, 1, 1, 1),  # mlp_only_layers=[0]
    "qwen2_moe": ([0, 1, 2], 16, 4, 1, 1, 1),  # shared_expert is not a routed expert
    "mixtral": ([0, 1, 2], 8, 2, 1, 1, 1),
    "olmoe": ([0, 1, 2], 16, 4, 1, 1, 1),
    "deepseek_v2": ([1, 2], 16, 4, 1, 1, 1),  # first_k_dense_replace=1, greedy router ignores n_group
    "deepseek_v2_grouped": ([1, 2], 16, 4, 4, 2, 1),
    "deepseek_v3": ([1, 2], 16, 4, 4, 2, 2),
    "glm4_moe": ([1, 2], 16, 4, 2, 1, 2),
    "gpt_oss": ([0, 1, 2], 8, 2, 1, 1, 1),
}

SUPPORTED = "deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe"


def test_every_tiny_architecture_is_covered():
    assert set(TINY_CONFIGS) == set(ARCHITECTURES)
    assert set(EXPECTED) == set(ARCH_IDS)
    assert supported_model_types() == SUPPORTED.split(", ")


@pytest.mark.parametrize("case", ARCH_IDS)
def test_find_moe_layers_matches_sparse_blocks(case):
    model = make_model(case)
    sparse, num_experts, top_k, num_groups, topk_group, group_score_topk = EXPECTED[case]
    layers = find_moe_layers(model)

    assert [layer.name for layer in layers] == [f"model.layers.{i}.mlp" for i in sparse]
    router_attr = ARCHITECTURES[ARCH_CASES[case][0]].router_attr
    for layer in layers:
        block = model.get_submodule(layer.name)
        assert layer.block is block
        assert layer.experts is block.experts
        assert layer.router is getattr(block, router_attr)
        assert (layer.num_experts, layer.top_k) == (num_experts, top_k)
        assert (layer.num_groups, layer.topk_group, layer.group_score_topk) == (num_groups, topk_group, group_score_topk)
        assert layer.routing == {
            "num_experts": num_experts,
            "top_k": top_k,
            "num_groups": num_groups,
            "topk_group": topk_group,
            "group_score_topk": group_score_topk,
        }
        # The expert count is the leading axis of every fused expert weight.
        weights = [p for p in layer.experts.parameters(recurse=False) if p.dim() == 3]
        assert weights and all(p.shape[0] == num_experts for p in weights)

    # Dense layers are skipped: their MLP has no routed experts at all.
    for i, decoder_layer in enumerate(model.model.layers):
        if i not in sparse:
            assert not hasattr(decoder_layer.mlp, "experts")
    # Shared experts are plain MLPs that are never reported as routed experts.
    reported = {id(layer.experts) for layer in layers}
    for name, module in model.named_modules():
        if "shared_expert" in name:
            assert id(module) not in reported
            assert not any(layer.name == name for layer in layers)


def test_shared_experts_exist_where_expected():
    """The tiny models really carry shared experts, so the test above can catch mistakes."""
    for case in ("qwen2_moe", "deepseek_v2", "deepseek_v3", "glm4_moe"):
        model = make_model(case)
        names = [name for name, _ in model.named_modules() if name.endswith(("shared_expert", "shared_experts"))]
        assert len(names) == len(EXPECTED[case][0])


def test_dense_layers_follow_config():
    """mlp_only_layers / first_k_dense_replace change which blocks are found."""
    qwen = tiny_model("qwen3_moe", mlp_only_layers=[1])
    assert [layer.name for layer in find_moe_layers(qwen)] == ["model.layers.0.mlp", "model.layers.2.mlp"]
    deepseek = tiny_model("deepseek_v3", first_k_dense_replace=2)
    assert [layer.name for layer in find_moe_layers(deepseek)] == ["model.layers.2.mlp"]


def _tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def test_unsupported_model_raises_listing_supported_types():
    model = _tiny_llama()
    expected = (
        "ompmoe cannot prune model_type='llama' (LlamaForCausalLM): no module holds a transformers-5 fused experts "
        "module (`.experts` with 3-D expert weights and an int `num_experts`). "
        f"Registered architectures: {SUPPORTED}."
    )
    with pytest.raises(UnsupportedModelError) as info:
        find_moe_layers(model)
    assert str(info.value) == expected
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnsupportedModelError):
        collect_stats(model, [torch.zeros(1, 4, dtype=torch.long)])


def test_model_without_config_is_unsupported():
    with pytest.raises(UnsupportedModelError, match=r"model_type=None \(Linear\)"):
        find_moe_layers(torch.nn.Linear(2, 2))


def test_supported_type_without_moe_layers_raises():
    model = tiny_model("qwen3_moe", mlp_only_layers=[0, 1, 2])
    expected = (
        "No MoE layer found in Qwen3MoeForCausalLM: expected sparse blocks with `.gate` and fused "
        "`.experts` (transformers>=5). Check that every layer is not dense (num_experts > 0, "
        "mlp_only_layers, first_k_dense_replace) and that the model was built by transformers 5.x."
    )
    with pytest.raises(ValueError) as info:
        find_moe_layers(model)
    assert str(info.value) == expected
    assert not isinstance(info.value, UnsupportedModelError)
