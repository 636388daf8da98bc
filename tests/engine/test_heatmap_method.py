"""The gain heatmap shows the pursuit the plan used (its order, its Gram) and says which in its title."""

import pytest
import torch

pytest.importorskip("matplotlib")

import ompmoe  # noqa: E402
from ompmoe.engine.export.plots import heatmap_figure, heatmap_pursuit  # noqa: E402
from ompmoe.engine.tiny import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def stats():
    generator = torch.Generator().manual_seed(0)
    model = tiny_model("qwen3_moe", seed=0)
    return ompmoe.collect_stats(model, [torch.randint(3, 256, (2, 32), generator=generator) for _ in range(2)])


def drawn_order(figure, layer: int) -> list[int]:
    """The expert ids down the y axis of the first panel (every tick is labelled on a tiny model)."""
    ax = figure.axes[layer]
    return [int(label.get_text()) for label in ax.get_yticklabels()]


@pytest.mark.parametrize("method", ["omp", "omp_normalized"])
def test_the_heatmap_follows_the_plans_pursuit(stats, method):
    plan = ompmoe.plan_pruning(stats, 0.5, method=method, allocation="uniform")
    name, gram_of = heatmap_pursuit(plan)
    assert name == method
    assert torch.equal(gram_of(stats.layers[0]), stats.layers[0].gram if method == "omp" else
                       stats.layers[0].gram_normalized)
    figure = heatmap_figure(stats, layers=[0], plan=plan)
    assert figure._suptitle.get_text().startswith(
        f"Reconstruction gain $\\Delta_e / \\|Y\\|^2$ of every candidate at every greedy step of {method}\n")
    labels = drawn_order(figure, 0)
    assert labels == plan.layers[0].order[:len(labels)]


def test_a_plan_that_is_no_pursuit_is_named_with_the_papers_order(stats):
    plan = ompmoe.plan_pruning(stats, 0.5, method="reap", allocation="uniform")
    figure = heatmap_figure(stats, layers=[0], plan=plan)
    assert "greedy step of omp (the plan's method, reap, is no pursuit: this is the paper's order)" in \
        figure._suptitle.get_text()
    assert drawn_order(figure, 0) == ompmoe.plan_pruning(stats, 0.5, method="omp").layers[0].order[
        :len(drawn_order(figure, 0))]
