"""FabricCalibration and ``ompmoe.lightning.fabric_prune`` under ``fabric run`` (2 CPU processes over gloo).

The script's job is ``ompmoe fit -c configs/tiny.yaml``'s, on fewer and shorter blocks (``JOB``). Under DDP and
under FSDP2 (``fabric run --strategy fsdp``) its statistics equal the one-process fit's to 1e-10 and it keeps the
same experts. This file runs the Fabric commands of README.md and docs/usage.md (with ``JOB``'s smaller data).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ompmoe
from ompmoe.data import byte_tokens, shipped_text, token_blocks
from ompmoe.engine.planning.allocation import InfeasibleBudgetError
from ompmoe.engine.io import OutputExistsError
from ompmoe.engine.tiny import tiny_model

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
JOB = ["--data.num_blocks", "5", "--data.seq_len", "64", "--data.batch_size", "1", "--plots", "false",
       "--evaluate_blocks", "4"]
"""configs/tiny.yaml's job on 5 blocks of 64 tokens (5 blocks on 2 ranks make the sampler repeat one), held-out
perplexity on 4 blocks per set (recorded in the plan: the runs compared measure the same text)."""
README_COMMAND = ('fabric run --accelerator cpu --devices 2 --strategy ddp "$(python -m ompmoe.lightning.fabric_prune '
                  '--path)" --output_dir outputs/fabric')
DOCS_COMMAND = ('fabric run --accelerator cpu --devices 2 --strategy fsdp "$(python -m ompmoe.lightning.fabric_prune '
                '--path)" --output_dir outputs/fabric-fsdp')
FABRIC_CLI = "import sys; from lightning.fabric.cli import _main; sys.exit(_main())"
"""``fabric run`` as the console script runs it (the script may live outside this interpreter's bin folder)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def check(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def fabric_run(cwd: Path, command: str) -> None:
    """``command`` in bash, where ``fabric`` is Lightning's CLI on this interpreter (on a free port)."""
    shim = f'fabric() {{ {shlex.quote(sys.executable)} -c {shlex.quote(FABRIC_CLI)} "$1" --main-port {free_port()} "${{@:2}}"; }}'
    check(subprocess.run(["bash", "-euo", "pipefail", "-c", f"{shim}\n{command}"], cwd=cwd, env=environment(),
                         capture_output=True, text=True, timeout=300))


def assert_stats_equal(got: ompmoe.MoEStats, expected: ompmoe.MoEStats, rtol: float = 1e-10) -> None:
    assert got.num_tokens == expected.num_tokens
    assert got.fingerprint == expected.fingerprint
    for a, b in zip(got.layers, expected.layers, strict=True):
        assert a.tensors().keys() == b.tensors().keys()
        for key, value in a.tensors().items():
            torch.testing.assert_close(value, b.tensors()[key], rtol=rtol, atol=rtol * float(b.tensors()[key].abs().max()))


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory) -> Path:
    """``ompmoe fit -c configs/tiny.yaml`` on ``JOB``'s data, in one process (its output directory)."""
    from ompmoe.cli import main

    out = tmp_path_factory.mktemp("fit") / "fit"
    threads, cwd = torch.get_num_threads(), os.getcwd()
    torch.set_num_threads(1)  # as the ranks (OMP_NUM_THREADS=1): the same kernels give the same bits
    os.chdir(out.parent)
    try:
        main(["fit", "-c", str(REPO / "configs" / "tiny.yaml"), *JOB[:6], "--quiet",
              "--trainer.callbacks.init_args.output_dir", str(out), "--trainer.callbacks.init_args.plots", "false",
              "--trainer.callbacks.init_args.evaluate_blocks", "4"])
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
    return out


def assert_same_run(out: Path, fit: Path) -> None:
    """Statistics to 1e-10, plan and kept experts, and the pruned model's weights as the one-process fit."""
    assert sorted(p.name for p in out.iterdir()) == [".ompmoe-output", "model", "plan.json", "stats.safetensors"]
    got, expected = ompmoe.MoEStats.load(out / "stats.safetensors"), ompmoe.MoEStats.load(fit / "stats.safetensors")
    assert got.num_tokens == 5 * 64  # the block rank 1's sampler repeats is not counted
    assert (got.model_id, got.sources) == (expected.model_id, expected.sources)
    assert_stats_equal(got, expected)
    plan = ompmoe.PruningPlan.load(out / "plan.json")
    assert plan.kept_by_layer() == ompmoe.PruningPlan.load(fit / "plan.json").kept_by_layer()
    assert plan == ompmoe.PruningPlan.load(fit / "plan.json")
    pruned, reference = ompmoe.load_pruned(out / "model"), ompmoe.load_pruned(fit / "model")
    assert ompmoe.pruning_info(pruned)["kept_experts"] == plan.kept_by_layer()
    expected_weights = reference.state_dict()
    for name, value in pruned.state_dict().items():
        assert torch.equal(value, expected_weights[name]), name
    assert (out / "model" / "tokenizer.json").is_file()  # the shipped model's tokenizer goes with it


@pytest.mark.distributed
@pytest.mark.slow
def test_the_readme_fabric_run_ddp_command_equals_ompmoe_fit(tmp_path, fit_run):
    assert README_COMMAND in (REPO / "README.md").read_text(encoding="utf-8")
    fabric_run(tmp_path, f"{README_COMMAND} {shlex.join(JOB)}")
    assert_same_run(tmp_path / "outputs" / "fabric", fit_run)


@pytest.mark.distributed
@pytest.mark.slow
def test_fabric_run_fsdp_shards_with_fsdp2_and_saves_the_whole_model(tmp_path, fit_run):
    """docs/usage.md's FSDP form on CPU: each decoder layer gathered whole for its forward, the checkpoint on rank 0."""
    assert DOCS_COMMAND in (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    fabric_run(tmp_path, f"{DOCS_COMMAND} {shlex.join(JOB)}")
    assert_same_run(tmp_path / "outputs" / "fabric-fsdp", fit_run)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_ranks_with_different_numbers_of_batches_sum_exactly(tmp_path, mode):
    """Rank 0 sees 3 batches, rank 1 two (one padded); FSDP2's run() keeps rank 1 in the weight all-gathers."""
    sys.path.insert(0, str(TESTS))
    from fabric_uneven import uneven_batches

    out = tmp_path / "out"
    check(subprocess.run([sys.executable, str(TESTS / "fabric_uneven.py"), str(out), mode], cwd=tmp_path,
                         env=environment(), capture_output=True, text=True, timeout=300))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = ompmoe.collect_stats(tiny_model("qwen3_moe"), uneven_batches(), loss_aware=True)
    finally:
        torch.set_num_threads(threads)
    got = ompmoe.MoEStats.load(out / "stats.safetensors")
    assert got.num_tokens == 24 * 7 - 7  # 7 blocks of 24 tokens, 7 of them padding
    assert_stats_equal(got, expected)
    plan = ompmoe.plan_pruning(expected, 0.5, min_kept_fraction=0.25)
    assert ompmoe.PruningPlan.load(out / "plan.json").kept_by_layer() == plan.kept_by_layer()


# ------------------------------------------------------------------------------------------------ one process
@pytest.fixture
def fabric():
    from lightning.fabric import Fabric

    return Fabric(accelerator="cpu", devices=1)


def blocks(count: int = 4, seq_len: int = 32) -> torch.Tensor:
    return token_blocks(byte_tokens(shipped_text()), seq_len, count)


class ForwardCounter:
    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.register_forward_pre_hook(self.count)

    def count(self, *args) -> None:
        self.calls += 1


def test_bad_settings_are_refused_before_any_forward_pass(tmp_path, fabric):
    from ompmoe.lightning.fabric import FabricCalibration

    model = fabric.setup(tiny_model("qwen3_moe"))
    counter = ForwardCounter(model.module)
    (tmp_path / "existing").mkdir()
    with pytest.raises(OutputExistsError) as error:
        FabricCalibration(fabric, model, output_dir=tmp_path / "existing")
    assert str(error.value) == (f"{tmp_path / 'existing'} already exists; pass --overwrite (overwrite=True in Python) "
                                "to replace it, or choose another output path.")
    with pytest.raises(InfeasibleBudgetError, match=r"use a ratio in \[0.1250, 0.6250\]"):
        FabricCalibration(fabric, model, ompmoe.PruningStrategy(ratio=0.9), output_dir=tmp_path / "new")
    with pytest.raises(ValueError) as error:
        FabricCalibration(fabric, model, ompmoe.PruningStrategy(method="omp_normalized", allocation="loss"))
    assert str(error.value) == (
        "The strategy's allocation 'loss' needs loss-aware statistics, which this calibration would not collect: "
        "pass FabricCalibration(..., loss_aware=True)."
    )
    with pytest.raises(TypeError) as error:
        FabricCalibration(fabric, tiny_model("qwen3_moe"))
    assert str(error.value) == (
        "FabricCalibration needs the model returned by fabric.setup(model); got Qwen3MoeForCausalLM. Call model = "
        "fabric.setup(model) first (it moves the model to the device and wraps it for the strategy)."
    )
    assert counter.calls == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]


def test_fsdp1_is_refused_with_the_fsdp2_alternative():
    from lightning.fabric.strategies import FSDPStrategy

    from ompmoe.lightning.fabric import FabricCalibration

    with pytest.raises(ValueError, match=r"use lightning\.fabric\.strategies\.ModelParallelStrategy\(parallelize_fn="
                                         r"ompmoe\.lightning\.fabric\.fsdp2"):
        FabricCalibration(SimpleNamespace(strategy=FSDPStrategy()), torch.nn.Linear(2, 2))


@pytest.mark.filterwarnings("ignore:No tokenizer was found")  # the random tiny model has none
@pytest.mark.parametrize("model_type", ["qwen3_moe", "llama4_text"])  # llama4_text: calibrated in its routed form
def test_one_process_equals_collect_stats_and_writes_like_the_callback(model_type, tmp_path, fabric):
    calibration_class = ompmoe.FabricCalibration  # the lazy export
    model = fabric.setup(tiny_model(model_type))
    data = blocks(4)
    calibration = calibration_class(fabric, model, ompmoe.PruningStrategy(ratio=0.5), output_dir=tmp_path / "run",
                                    plots=False, extra_ratios=[0.25])
    assert calibration.run(fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=2))) == 2
    plan = calibration.finish()
    expected = ompmoe.collect_stats(tiny_model(model_type), [data[:2], data[2:]])
    assert_stats_equal(calibration.stats, expected, rtol=1e-12)
    assert plan == ompmoe.plan_pruning(expected, 0.5) == ompmoe.PruningPlan.load(tmp_path / "run" / "plan.json")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        ".ompmoe-output", "model", "plan-0.25.json", "plan.json", "stats.safetensors"]
    reference = ompmoe.prune(tiny_model(model_type), plan)
    with torch.no_grad():
        torch.testing.assert_close(ompmoe.load_pruned(tmp_path / "run" / "model")(data[:1]).logits,
                                   reference(data[:1]).logits, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"finish\(\) was called already"):
        calibration.update(data[:1])


def test_auto_with_choice_blocks_keeps_the_candidate_whose_pruned_model_has_the_lowest_loss(fabric, tmp_path):
    auto = ompmoe.PruningStrategy(ratio=0.5, method="auto", allocation="auto")
    calibration = ompmoe.FabricCalibration(fabric, fabric.setup(tiny_model("qwen3_moe")), auto,
                                           output_dir=tmp_path / "run", plots=False, save_model=False,
                                           extra_ratios=[0.25])
    data, held_out = blocks(6)[:4], blocks(6)[4:]
    calibration.run(data[:, None])
    plan = calibration.finish(choice_blocks=held_out)
    expected = ompmoe.choose_plan(tiny_model("qwen3_moe"), auto.candidates(calibration.stats), held_out)
    assert calibration.choice.losses == pytest.approx(expected.losses, abs=1e-6)
    # the chosen candidate, plus the record of its compensation
    assert dataclasses.replace(plan, extra={}) == expected.plan and calibration.choice.index == expected.index
    record = plan.extra["compensation"]  # the down refit or the linear map, the lower loss on the choice blocks
    assert record["fitted"] == "down" and set(record["tried"]) == {"linear", "down, alpha 0.1"}
    assert record["granularity"] == ("linear" if min(record["tried"], key=record["tried"].get) == "linear" else "down")
    extra = ompmoe.PruningPlan.load(tmp_path / "run" / "plan-0.25.json")  # the other ratio uses the chosen setting
    assert (extra.method, extra.allocation) == (plan.method, plan.allocation)


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_fabric_precisions_calibrate_the_model_as_fabric_runs_it(precision):
    """bf16-true: weights converted to bf16; bf16-mixed: float32 weights under bf16 autocast."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    paper = ompmoe.PruningStrategy(method="omp", allocation="waterfill")  # forward-only statistics
    calibration = ompmoe.FabricCalibration(fabric, fabric.setup(tiny_model("qwen3_moe")), paper)
    data = blocks(2)
    calibration.run(data[:, None])  # one block per batch
    calibration.finish()
    reference = tiny_model("qwen3_moe")
    if precision == "bf16-true":
        expected = ompmoe.collect_stats(reference.to(torch.bfloat16), data[:, None])
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = ompmoe.collect_stats(reference, data[:, None])
    assert_stats_equal(calibration.stats, expected, rtol=1e-12)


@pytest.mark.filterwarnings("ignore:No tokenizer was found")
def test_a_run_killed_before_or_while_writing_leaves_no_output(tmp_path, fabric, monkeypatch):
    import ompmoe.engine.io

    model = fabric.setup(tiny_model("qwen3_moe"))
    calibration = ompmoe.FabricCalibration(fabric, model, output_dir=tmp_path / "run", plots=False)
    with pytest.raises(KeyboardInterrupt):
        for index, batch in enumerate(blocks(4)[:, None]):
            if index == 2:
                raise KeyboardInterrupt  # killed mid-calibration: finish() never ran
            calibration.update(batch)
    # nothing written; only the reservation of the live run (refusing a second run into run/) until it ends
    assert [path.name for path in tmp_path.iterdir()] == [calibration.pruning.reservation.lock.path.name]

    def killed(step: str) -> None:
        if step == "written":  # every file is in the temporary directory, nothing renamed yet
            raise KeyboardInterrupt

    monkeypatch.setattr(ompmoe.engine.io, "_step", killed)
    with pytest.raises(KeyboardInterrupt):
        calibration.finish()
    assert list(tmp_path.iterdir()) == []  # no output, no temporary, no lock file


def test_the_script_prints_its_path_for_fabric_run(capsys):
    from ompmoe.lightning import fabric_prune

    fabric_prune.main(["--path"])
    assert capsys.readouterr().out.strip() == os.path.abspath(fabric_prune.__file__)
    defaults = fabric_prune.parser().parse_args([])
    assert (defaults.model.model, defaults.data.source, defaults.data.seq_len, defaults.data.num_blocks,
            defaults.data.batch_size, defaults.evaluate_on) == (
        "shipped:tiny-moe", "shipped:mix", 256, 16, 4, ["heldout:prose", "heldout:code"])  # configs/tiny.yaml's job
    assert (defaults.ratio, defaults.method, defaults.allocation, defaults.loss_aware) == (
        0.5, "auto", "auto", False)  # auto collects the loss-aware statistics the recommended setting needs


def test_the_script_refuses_an_existing_output_before_loading_the_model(tmp_path, capsys, monkeypatch):
    from ompmoe.lightning import fabric_prune

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    loaded = []
    monkeypatch.setattr("ompmoe.lightning.models.load_model", lambda *args: loaded.append(args))
    with pytest.raises(SystemExit) as exit_status:
        fabric_prune.cli(["--accelerator", "cpu", "--devices", "1", "--output_dir", "out"])
    assert exit_status.value.code == 2 and loaded == []
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: out already exists; pass --overwrite (overwrite=True in Python) to replace it, or choose another "
        "output path.")


def test_a_tensor_dataset_loader_calibrates_as_its_tensors_do(fabric):
    """The (ids[, mask]) lists a TensorDataset loader yields, which ExpertPruning takes, were refused ('got list')."""
    data = blocks(4)
    mask = torch.ones_like(data)
    mask[1, 20:] = 0
    statistics = []
    for batches in ([[ids, part] for ids, part in zip(data.split(2), mask.split(2))],
                    [{"input_ids": ids, "attention_mask": part} for ids, part in zip(data.split(2), mask.split(2))]):
        calibration = ompmoe.FabricCalibration(fabric, fabric.setup(tiny_model("qwen3_moe")),
                                               ompmoe.PruningStrategy(ratio=0.5), plots=False)
        for batch in batches:
            calibration.update(batch)
        calibration.finish()
        statistics.append(calibration.stats)
    assert statistics[0].num_tokens == statistics[1].num_tokens == data.numel() - 12
    assert_stats_equal(statistics[0], statistics[1], rtol=0)


def test_a_second_epoch_over_the_same_loader_counts_as_the_first_whatever_the_sampler(fabric, tmp_path):
    """Rank 1 of 2 over 5 blocks gets blocks 1 and 3 and a padded repeat of block 0. A second epoch over the same
    loader kept counting positions from the first: every sample of it was taken for a repeat and left out, on 2
    processes only (one process counted it). Each epoch now counts its real samples, and a Fabric loader's own
    epochs too; a loop that never calls ``set_epoch`` starts a new pass once a pass's samples are used up."""
    from torch.utils.data import DataLoader, DistributedSampler

    from ompmoe.lightning.fabric import FabricCalibration

    data = blocks(5)

    def rank_one() -> DataLoader:
        return DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=1, shuffle=False))

    # a plain loader whose sampler the loop moves to each epoch; one whose loop never does (each pass then yields
    # the rank's samples in the same order); a Fabric loader, which does that itself
    loaders = {"set_epoch": rank_one(), "no_set_epoch": rank_one(),
               "fabric": fabric.setup_dataloaders(rank_one(), use_distributed_sampler=False)}
    expected = ompmoe.collect_stats(tiny_model("qwen3_moe"), [data[[1, 3]], data[[1, 3]]])
    for name, loader in loaders.items():
        model = fabric.setup(tiny_model("qwen3_moe"))
        calibration = FabricCalibration(fabric, model, ompmoe.PruningStrategy(ratio=0.5, min_kept_fraction=0.25),
                                        output_dir=tmp_path / name, plots=False)
        for epoch in range(2):
            if name == "set_epoch":
                loader.sampler.set_epoch(epoch)
            for batch in loader:
                calibration.update(batch, loader)
        calibration.finish()
        assert_stats_equal(calibration.stats, expected)
