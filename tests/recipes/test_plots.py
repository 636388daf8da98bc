"""ompmoe.recipes.plots: PNG files, the high-contribution table, the callback's plots and `ompmoe plot`."""

from __future__ import annotations

import csv
import io
import struct

import pytest
import torch
from torch.utils.data import DataLoader

import ompmoe
from ompmoe import MoEStats, OutputExistsError, collect_stats, plan_pruning
from ompmoe.cli import main
from ompmoe.recipes.plots import (
    PLOT_FILES,
    high_contribution_experts,
    high_contribution_table,
    layer_index,
    write_plots,
)
from ompmoe.engine.statistics import LayerStats
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
    assert [p.name for p in paths] == list(PLOT_FILES)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(PLOT_FILES)  # no temporaries
    for path in paths:
        assert path.stat().st_size > 0
        if path.suffix == ".png":
            width, height = png_size(path)
            assert width > 200 and height > 200
    header = (tmp_path / "plots" / "high_contribution.csv").read_text().splitlines()[0]
    assert header == "layer,layer_index,expert,residual_r1,token_share"
    assert (tmp_path / "plots" / "high_contribution.md").read_text().startswith("| Layer | Layer index |")
    # Existing files are refused unless overwrite=True.
    with pytest.raises(OutputExistsError):
        write_plots(stats, tmp_path / "plots")
    assert write_plots(stats, tmp_path / "plots", overwrite=True) == paths
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
    stats = MoEStats(layers=layers, num_tokens=100, fingerprint="synthetic")
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
    assert rows[0].token_share == pytest.approx(1 / (36 / 2))  # expert 0 has 1 of the 18 routed tokens
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
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(PLOT_FILES)
    for name in PLOT_FILES:
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
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted([".ompmoe-output", *PLOT_FILES])
    assert str(tmp_path / "plots" / "heatmaps.png") in capsys.readouterr().out
    with pytest.raises(SystemExit) as error:
        main(["plot", "--stats", str(stats_file), "--output_dir", str(tmp_path / "plots")])
    assert "already exists; pass overwrite=True" in str(error.value)
    main(["plot", "--stats", str(stats_file), "--output_dir", str(tmp_path / "plots"), "--overwrite", "true"])
    with pytest.raises(SystemExit) as error:
        main(["plot", "--stats", str(tmp_path / "missing.safetensors"), "--output_dir", str(tmp_path / "p2")])
    assert "No statistics file at" in str(error.value)
    assert not (tmp_path / "p2").exists()


def test_cli_prune_with_a_baseline_method(stats, tmp_path):
    stats_file = stats.save(tmp_path / "stats.safetensors")
    main(["prune", "--stats", str(stats_file), "--ratio", "[0.5]", "--output_dir", str(tmp_path / "plans"),
          "--method", "reap", "--allocation", "optimal"])
    plan = ompmoe.PruningPlan.load(tmp_path / "plans" / "plan-0.5.json")
    assert plan == plan_pruning(ompmoe.MoEStats.load(stats_file), 0.5, method="reap", allocation="optimal")
