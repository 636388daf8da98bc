"""Ctrl-C during calibration: one line saying nothing was written and what to do, no traceback, no output."""

import signal

import pytest

from ompmoe.cli import main
from ompmoe.lightning.calibration_module import CalibrationModule

from test_cli import tiny_config


@pytest.fixture
def sigint_restored():
    handler = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT while it shuts down
    yield
    signal.signal(signal.SIGINT, handler)


def interrupt_at(batch: int):
    real = CalibrationModule.training_step

    def training_step(self, inputs, batch_idx):
        if batch_idx == batch:
            raise KeyboardInterrupt
        return real(self, inputs, batch_idx)

    return training_step


def assert_interrupted_after_2_of_5(exit_info, capsys, out):
    """Exit 130, the one interrupted line last on stderr, no traceback, and no output written."""
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"ompmoe: interrupted after 2 of 5 calibration batches; nothing was "
                                            f"written ({out} is as it was): run the same command again to redo it")
    assert "Traceback" not in err and not out.exists()


def test_fit_interrupted_says_nothing_was_written(tmp_path, capsys, monkeypatch, sigint_restored):
    monkeypatch.setattr(CalibrationModule, "training_step", interrupt_at(2))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(tiny_config(tmp_path)), "--data.batch_size", "1", "--trainer.enable_progress_bar=false"])
    assert exit_info.value.code == 1  # Lightning's status after its graceful shutdown
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("ompmoe:")]
    assert ours == [f"ompmoe: interrupted after 2 of 4 calibration batches; nothing was written ({tmp_path / 'run'} "
                    "is as it was): run the same command again to redo it"]
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_the_fabric_script_interrupted_says_so_and_exits_130(tmp_path, capsys, monkeypatch):
    from ompmoe.lightning import fabric, fabric_prune

    real, calls = fabric.FabricCalibration.update, []

    def update(self, batch, dataloader=None):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, batch, dataloader)

    monkeypatch.setattr(fabric.FabricCalibration, "update", update)
    out = tmp_path / "fabric"
    with pytest.raises(SystemExit) as exit_info:
        fabric_prune.cli(["--data.num_blocks", "5", "--data.seq_len", "64", "--data.batch_size", "1", "--plots",
                          "false", "--output_dir", str(out)])
    assert_interrupted_after_2_of_5(exit_info, capsys, out)


def test_the_demo_interrupted_says_so_and_exits_130(tmp_path, capsys, monkeypatch):
    import sys

    from ompmoe.engine.collect.collector import StatisticsCollector
    from ompmoe.recipes import quickstart

    real, calls = StatisticsCollector.calibrate, []

    def calibrate(self, inputs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, inputs)

    monkeypatch.setattr(StatisticsCollector, "calibrate", calibrate)
    out = tmp_path / "demo"
    monkeypatch.setattr(sys, "argv", ["ompmoe-demo", "--model", "tiny", "--seq_len", "32", "--num_blocks", "5",
                                      "--batch_size", "1", "--output_dir", str(out)])
    with pytest.raises(SystemExit) as exit_info:
        quickstart.main()
    assert_interrupted_after_2_of_5(exit_info, capsys, out)


def test_prune_interrupted_between_ratios_leaves_the_output_as_it_was(tmp_path, capsys, monkeypatch):
    from ompmoe.engine.planning.plan import PruningPlan
    from ompmoe.engine.collect.synthetic import synthetic_stats

    stats = str(synthetic_stats(4, 16, 4).save(tmp_path / "stats.safetensors"))
    out = tmp_path / "plans"
    main(["prune", "--stats", stats, "--ratio", "[0.25]", "--output_dir", str(out), "--quiet"])
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert "plan-0.25.json" in before
    real, saves = PruningPlan.save, []

    def save(self, path, *args, **kwargs):
        saves.append(path)
        if len(saves) == 2:  # the second of three ratios
            raise KeyboardInterrupt
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(PruningPlan, "save", save)
    with pytest.raises(SystemExit) as exit_info:
        main(["prune", "--stats", stats, "--ratio", "[0.25,0.5,0.6]", "--output_dir", str(out), "--overwrite"])
    assert exit_info.value.code == 130 and len(saves) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"ompmoe: interrupted; nothing was written ({out} is as it was): run the same "
                                "command again to redo it"]
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["plans", "stats.safetensors"]  # no temporary left


def test_fit_interrupted_while_writing_says_so_not_after_its_batches(tmp_path, capsys, monkeypatch, sigint_restored):
    """Issue 44, item 7: Ctrl-C once every batch ran (here while the pruned model is saved) is not "after 4 of 4
    calibration batches"; the output stays as it was, with no temporary left beside it."""
    from ompmoe.engine.run import PruningRun

    def save_model(self, model, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(PruningRun, "save_model", save_model)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(tiny_config(tmp_path)), "--trainer.enable_progress_bar=false"])
    assert exit_info.value.code == 1  # Lightning's status after its graceful shutdown
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("ompmoe: interrupted")]
    assert ours == [f"ompmoe: interrupted after calibration, while pruning and writing {tmp_path / 'run'}; nothing was "
                    f"written ({tmp_path / 'run'} is as it was): run the same command again to redo it"]
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists() and not [path for path in tmp_path.iterdir() if path.name.startswith(".")]
