"""Sequential calibration (ompmoe.engine.sequential) against pruning and re-collecting by hand."""

from __future__ import annotations

import copy
import dataclasses

import torch

from ompmoe import collect_stats, plan_pruning, prune
from ompmoe.engine.selection import greedy_pursuit
from ompmoe.engine.sequential import sequential_plan
from ompmoe.engine.tiny import tiny_model


def test_each_layer_is_reselected_on_the_pruned_predecessors():
    model = tiny_model("qwen3_moe", num_hidden_layers=4)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 256, (2, 32), generator=generator) for _ in range(2)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_pruning(collect_stats(model, batches), 0.5, allocation="optimal")
    result = sequential_plan(model, batches, plan)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # model untouched
    assert [layer.num_kept for layer in result.layers] == [layer.num_kept for layer in plan.layers]
    assert result.layers[0] == plan.layers[0] and result.extra["sequential"] is True
    # By hand: prune the layers before l to their final sets, collect, run the pursuit on layer l.
    for index in range(1, len(plan.layers)):
        everything = [dataclasses.replace(p, kept=list(range(p.num_experts))) for p in plan.layers[index:]]
        partial = dataclasses.replace(plan, layers=result.layers[:index] + everything)
        layer = collect_stats(prune(copy.deepcopy(model), partial), batches).layers[index]
        order = greedy_pursuit(layer.gram, with_gains=False).order
        count = plan.layers[index].num_kept
        assert result.layers[index].kept == sorted(order[:count].tolist())
        assert result.layers[index].order == order.tolist()
    # The pruned predecessors change what later layers see (else this test could not tell the two apart).
    assert any(a.kept != b.kept for a, b in zip(result.layers, plan.layers))
    pruned = prune(copy.deepcopy(model), result)  # the plan applies as any other
    assert pruned is not None
