"""ompmoe.engine.export.plots: PNG files, the high-contribution table, the callback's plots and `ompmoe plot`."""

from __future__ import annotations

import csv
import io
import struct

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import ompmoe
from ompmoe import MoEStats, OutputExistsError, collect_stats, plan_pruning
from ompmoe.cli import main
from ompmoe.engine.export.plots import (
    PLAN_PLOT_FILES,
    PLOT_FILES,
    high_contribution_experts,
    high_contribution_table,
    layer_index,
    write_plots,
)
from ompmoe.engine.collect.statistics import LayerStats
from ompmoe.engine.tiny import tiny_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", path
    assert data.endswith(b"IEND\xaeB`\x82"), path  # complete file
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def stats() -> MoEStats:
    model = tiny_model("deepseek_v3", num_hidden_layers=4)  # three grouped MoE layers
    generator = torch.Generator().manual_seed(0)
    return collect_stats(model, [torch.randint(3, 256, (2, 32), generator=generator) for _ in range(2)])


def test_write_plots_writes_valid_pngs_and_tables(stats, tmp_path):
    plan = plan_pruning(stats, 0.5, method="reap")
    paths = write_plots(stats, tmp_path / "plots", plan=plan)
    assert [p.name for p in paths] == list(PLOT_FILES + PLAN_PLOT_FILES)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(PLOT_FILES + PLAN_PLOT_FILES)  # no temporaries
    for path in paths:
        assert path.stat().st_size > 0
        if path.suffix == ".png":
            width, height = png_size(path)
            assert width > 200 and height > 200
    header = (tmp_path / "plots" / "high_contribution.csv").read_text().splitlines()[0]
    assert header == "layer,layer_index,expert,residual_r1,token_share"
    assert "| Layer | Layer index |" in (tmp_path / "plots" / "high_contribution.md").read_text()
    # Existing files are refused unless overwrite=True.
    with pytest.raises(OutputExistsError):
        write_plots(stats, tmp_path / "plots")
    assert write_plots(stats, tmp_path / "plots", overwrite=True) == paths[: len(PLOT_FILES)]
    # A plan from other statistics is refused.
    other = collect_stats(tiny_model("qwen3_moe"), [torch.randint(3, 256, (1, 16))])
    with pytest.raises(ValueError, match="was not made from these statistics"):
        write_plots(stats, tmp_path / "other", plan=plan_pruning(other, 0.5))


def _diagonal_layer(index: int, energies: list[float], mixing: float = 0.0) -> LayerStats:
    """Orthogonal atoms with the given energies, optionally mixed so the Gram is not diagonal."""
    n = len(energies)
    atoms = torch.diag(torch.tensor(energies, dtype=torch.float64).sqrt())
    atoms = atoms + mixing * torch.ones(n, n, dtype=torch.float64) / n
    gram = atoms @ atoms.T
    counts = torch.arange(1, n + 1, dtype=torch.float64)
    return LayerStats(
        name=f"model.layers.{index}.mlp", num_experts=n, top_k=2, num_groups=1, topk_group=1, group_score_topk=1,
        gram=gram, routing_mass=counts / 2, token_count=counts, sq_norm_sum=gram.diagonal(), norm_sum=counts,
        weighted_norm_sum=counts,
    )


def literal_first_residuals(layer: LayerStats) -> list[float]:
    """r(1) of keeping each single expert e: ||Y - V_e||^2 / ||Y||^2 from the Gram."""
    g, n = layer.gram, layer.num_experts
    total = float(g.sum())
    return [(total - 2 * float(g[:, e].sum()) + float(g[e, e])) / total for e in range(n)]


def test_high_contribution_table_lists_exactly_the_layers_below_0_1():
    layers = [
        _diagonal_layer(1, [0.95] + [0.05 / 7] * 7),  # r(1) = 0.05: listed, expert 0
        _diagonal_layer(2, [1.0] * 8),  # r(1) = 0.875
        _diagonal_layer(3, [0.02] * 3 + [0.89] + [0.05 / 4] * 4),  # r(1) = 0.11: not listed
        _diagonal_layer(5, [0.01] * 6 + [0.93, 0.01], mixing=0.02),  # r(1) = 0.091: listed, expert 6
        _diagonal_layer(6, [0.2] * 5 + [0.0] * 3, mixing=0.3),
    ]
    stats = MoEStats(layers=layers, num_tokens=18, fingerprint="synthetic")  # 36 routed pairs of top-2 in each
    expected = []
    for layer in layers:
        residuals = literal_first_residuals(layer)
        best = min(range(layer.num_experts), key=lambda e: (residuals[e], e))
        if residuals[best] < 0.1:
            expected.append((layer.name, best, residuals[best]))
    assert [(name, expert) for name, expert, _ in expected] == [("model.layers.1.mlp", 0), ("model.layers.5.mlp", 6)]
    rows = high_contribution_experts(stats)
    assert [(row.layer, row.expert) for row in rows] == [(name, expert) for name, expert, _ in expected]
    for row, (_, _, residual) in zip(rows, expected):
        assert row.residual == pytest.approx(residual, rel=1e-12)
    assert [row.layer_index for row in rows] == [1, 5]
    assert rows[0].token_share == pytest.approx(1 / 18)  # expert 0 has 1 of the 18 tokens
    # The threshold is strict and configurable.
    assert [row.layer for row in high_contribution_experts(stats, threshold=0.12)] == [
        "model.layers.1.mlp", "model.layers.3.mlp", "model.layers.5.mlp"
    ]
    markdown = high_contribution_table(rows)
    assert markdown.splitlines()[2] == f"| model.layers.1.mlp | 1 | 0 | {expected[0][2]:.4f} | {rows[0].token_share:.3f} |"
    assert len(markdown.splitlines()) == 2 + 2
    parsed = list(csv.DictReader(io.StringIO(high_contribution_table(rows, "csv"))))
    assert [(r["layer"], int(r["expert"]), float(r["residual_r1"])) for r in parsed] == [
        (name, expert, residual) for name, expert, residual in [(row.layer, row.expert, row.residual) for row in rows]
    ]
    with pytest.raises(ValueError, match="Unknown table format"):
        high_contribution_table(rows, "latex")


def test_layer_index_from_module_names():
    assert layer_index("model.layers.12.mlp", 0) == 12
    assert layer_index("transformer.h.3.moe", 0) == 3
    assert layer_index("moe", 7) == 7


def test_callback_writes_plots_inside_its_output_directory(tmp_path):
    from reference import batches, trainer

    from ompmoe.lightning.calibration_module import CalibrationModule
    from ompmoe.callbacks import ExpertPruning

    callback = ExpertPruning(ompmoe.PruningStrategy(ratio=0.5, method="frequency"), output_dir=str(tmp_path / "run"), save_model=False)
    trainer(callbacks=[callback]).fit(CalibrationModule("tiny:olmoe"), DataLoader(batches(2), batch_size=2))
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == [".ompmoe-output", "plan.json", "plots", "stats.safetensors"]
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(PLOT_FILES + PLAN_PLOT_FILES)
    for name in PLOT_FILES + PLAN_PLOT_FILES:
        if name.endswith(".png"):
            png_size(run / "plots" / name)
    assert callback.plan.method == "frequency"

    quiet = ExpertPruning(output_dir=str(tmp_path / "quiet"), save_model=False, plots=False)
    trainer(callbacks=[quiet]).fit(CalibrationModule("tiny:olmoe"), DataLoader(batches(2), batch_size=2))
    assert sorted(p.name for p in (tmp_path / "quiet").iterdir()) == [".ompmoe-output", "plan.json", "stats.safetensors"]


def test_cli_plot_command(stats, tmp_path, capsys):
    stats_file = stats.save(tmp_path / "stats.safetensors")
    plan_file = plan_pruning(stats, 0.5).save(tmp_path / "plan.json")
    main(["plot", "--stats", str(stats_file), "--output_dir", str(tmp_path / "plots"), "--plan", str(plan_file)])
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted([".ompmoe-output", *PLOT_FILES,
                                                                            *PLAN_PLOT_FILES])
    assert str(tmp_path / "plots" / "heatmaps.png") in capsys.readouterr().out
    with pytest.raises(SystemExit) as error:
        main(["plot", "--stats", str(stats_file), "--output_dir", str(tmp_path / "plots")])
    assert "already exists; pass --overwrite (overwrite=True in Python)" in str(error.value)
    main(["plot", "--stats", str(stats_file), "--output_dir", str(tmp_path / "plots"), "--overwrite", "true"])
    with pytest.raises(SystemExit) as error:
        main(["plot", "--stats", str(tmp_path / "missing.safetensors"), "--output_dir", str(tmp_path / "p2")])
    assert str(error.value) == (f"error: statistics file {str(tmp_path / 'missing.safetensors')!r} does not exist; "
                                f"did you mean {str(stats_file)!r}?")  # the statistics file beside it
    assert not (tmp_path / "p2").exists()


def test_cli_prune_with_a_baseline_method(stats, tmp_path):
    stats_file = stats.save(tmp_path / "stats.safetensors")
    main(["prune", "--stats", str(stats_file), "--ratio", "[0.5]", "--output_dir", str(tmp_path / "plans"),
          "--method", "reap", "--allocation", "optimal"])
    plan = ompmoe.PruningPlan.load(tmp_path / "plans" / "plan-0.5.json")
    assert plan == plan_pruning(ompmoe.MoEStats.load(stats_file), 0.5, method="reap", allocation="optimal")


# ------------------------------------------------------------------------ at real scale (48 x 128)
@pytest.fixture(scope="module")
def large():
    from ompmoe.engine.collect.synthetic import synthetic_stats

    stats = synthetic_stats(48, 128, 8)
    return stats, plan_pruning(stats, 0.5)


def test_synthetic_statistics_have_the_requested_shape_and_are_valid(large, tmp_path):
    stats, plan = large
    assert [(layer.num_experts, layer.top_k) for layer in stats.layers] == [(128, 8)] * 48
    loaded = MoEStats.load(stats.save(tmp_path / "s.safetensors"))  # passes the file checks (PSD, symmetric, ...)
    assert torch.equal(loaded.layers[5].gram, stats.layers[5].gram)
    assert [row.layer_index for row in high_contribution_experts(stats)] == [11, 35]  # the dominant-expert layers
    assert plan.achieved_ratio == pytest.approx(0.5)


def test_heatmaps_at_scale_share_one_log_scale_with_readable_rows(large):
    from matplotlib.colors import LogNorm

    from ompmoe.engine.export.plots import heatmap_figure, heatmap_layers

    stats, _ = large
    assert heatmap_layers(48) == [0, 4, 9, 13, 17, 21, 26, 30, 34, 38, 43, 47]
    assert heatmap_layers(6) == [0, 1, 2, 3, 4, 5]
    figure = heatmap_figure(stats)
    images = [image for ax in figure.axes for image in ax.get_images()]
    assert len(images) == 12
    assert all(image.norm is images[0].norm for image in images) and isinstance(images[0].norm, LogNorm)
    figure.canvas.draw()
    panel = images[0].axes.get_window_extent()
    assert panel.height / 128 >= 3.0  # pixels per expert row
    titles = [ax.get_title() for ax in figure.axes if ax.get_images()]
    assert titles[:2] == ["layer 0 (128 experts)", "layer 4 (128 experts)"]
    assert any("log scale, shared by all panels" in ax.get_ylabel() for ax in figure.axes)


def test_residual_panels_name_their_own_kept_count(large):
    from ompmoe.engine.export.plots import residual_figure

    stats, plan = large
    figure = residual_figure(stats, plan)
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles == [f"layer {i}: kept {layer.num_kept}/128" for i, layer in enumerate(plan.layers)]
    assert [text.get_text() for text in figure.legends[0].get_texts()] == [
        "residual r(k) (OMP)", "routing risk -log(C(k)+zeta)", "experts kept (plan)"]


def test_overview_is_a_layers_by_k_map_with_the_kept_counts(large):
    from ompmoe.engine.export.plots import overview_figure

    stats, plan = large
    figure = overview_figure(stats, plan)
    ax = figure.axes[0]
    (image,) = ax.get_images()
    expected = np.array([ompmoe.greedy_pursuit(layer.gram).residual.numpy() for layer in stats.layers])
    np.testing.assert_allclose(np.asarray(image.get_array()), expected, rtol=1e-12)
    (markers,) = [line for line in ax.get_lines() if line.get_marker() == "o"]
    assert list(markers.get_xdata()) == [layer.num_kept for layer in plan.layers]


def test_allocation_figure_and_csvs_hold_the_plan(large, tmp_path):
    stats, plan = large
    from ompmoe.engine.collect.synthetic import synthetic_stats

    small = synthetic_stats(3, 16, 4)
    small_plan = plan_pruning(small, 0.5)
    write_plots(small, tmp_path, plan=small_plan, progress=False)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "allocation.csv").read_text())))
    assert [(r["layer"], int(r["kept"]), float(r["uniform_kept"])) for r in rows] == [
        (layer.name, layer.num_kept, 8.0) for layer in small_plan.layers]
    assert [float(r["residual"]) for r in rows] == [layer.residual[layer.num_kept] for layer in small_plan.layers]
    curves = list(csv.DictReader(io.StringIO((tmp_path / "residual_curves.csv").read_text())))
    assert len(curves) == 3 * 17
    for layer in small.layers:
        mine = [float(r["residual"]) for r in curves if r["layer"] == layer.name]
        assert mine == ompmoe.greedy_pursuit(layer.gram).residual.tolist()
    from ompmoe.engine.export.plots import allocation_figure

    ax = allocation_figure(stats, plan).axes[0]
    kept_bars = [patch.get_height() for patch in ax.containers[1]]
    assert kept_bars == [layer.num_kept for layer in plan.layers]
    assert ax.get_title() == "Allocation: kept 3072/6144 routed experts (removed 0.500)"


def test_expert_counts_get_whole_number_ticks():
    from ompmoe.engine.collect.synthetic import synthetic_stats
    from ompmoe.engine.export.plots import allocation_figure, residual_figure

    small = synthetic_stats(6, 16, 4)
    plan = plan_pruning(small, 0.5)
    figure = allocation_figure(small, plan)
    figure.canvas.draw()
    ticks = figure.axes[0].get_yticks()
    assert len(ticks) >= 3 and all(float(tick).is_integer() for tick in ticks)
    figure = residual_figure(small, plan)
    figure.canvas.draw()
    assert all(float(tick).is_integer() for tick in figure.axes[0].get_xticks())


@pytest.mark.parametrize("num_layers, columns", [(6, 3), (48, 7)])
def test_residual_curves_are_near_square_with_readable_text(num_layers, columns, tmp_path):
    from ompmoe.engine.collect.synthetic import synthetic_stats

    small = synthetic_stats(num_layers, 16, 4)
    write_plots(small, tmp_path, plan=plan_pruning(small, 0.5), progress=False)
    width, height = png_size(tmp_path / "residual_curves.png")
    assert 0.8 <= width / height <= 2.0, (width, height)  # not a strip
    from ompmoe.engine.export.plots import residual_figure

    figure = residual_figure(small, plan_pruning(small, 0.5))
    panels = [ax for ax in figure.axes if ax.get_title()]
    assert len({round(ax.get_position().x0, 3) for ax in panels}) == columns
    assert min(ax.title.get_fontsize() for ax in panels) >= 10
    assert min(label.get_fontsize() for label in panels[0].get_xticklabels()) >= 8


def test_high_contribution_markdown_says_when_no_layer_qualifies(tmp_path):
    stats = MoEStats(layers=[_diagonal_layer(0, [1.0] * 8)], num_tokens=10, fingerprint="synthetic")
    write_plots(stats, tmp_path, progress=False)
    text = (tmp_path / "high_contribution.md").read_text()
    assert text.splitlines()[0] == ("No layer qualifies: in every layer the first expert picked leaves "
                                    "r_l(1) >= 0.1 (no single expert reconstructs 90% of its layer's routed output).")
    assert (tmp_path / "high_contribution.csv").read_text() == "layer,layer_index,expert,residual_r1,token_share\n"
