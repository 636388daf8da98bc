"""ExpertPruning in a plain Trainer, under DDP and FSDP2 on CPU, and across checkpoints."""

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers.logger import DummyLogger
from torch.utils.data import DataLoader

import ompmoe
from ompmoe.engine.planning.allocation import InfeasibleBudgetError
from ompmoe.lightning.calibration_data import ResumableDataLoader
from ompmoe.lightning.calibration_module import CalibrationModule
from ompmoe.callbacks import ExpertPruning
from ompmoe.data import byte_tokens, shipped_text, token_blocks
from ompmoe.engine.io import OutputExistsError
from ompmoe import PruningStrategy
from ompmoe.engine.tiny import tiny_model

from reference import ForwardCounter, batches, trainer

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def assert_stats_equal(a: ompmoe.MoEStats, b: ompmoe.MoEStats, rtol: float = 1e-12) -> None:
    assert a.num_tokens == b.num_tokens
    for la, lb in zip(a.layers, b.layers, strict=True):
        for key, value in la.tensors().items():
            torch.testing.assert_close(value, lb.tensors()[key], rtol=rtol, atol=rtol * float(value.abs().max()))


class WithValidation(CalibrationModule):
    def validation_step(self, batch, batch_idx):
        with torch.no_grad():
            self(**batch)

    def val_dataloader(self):
        return DataLoader(batches(4)[::-1], batch_size=2)


def test_fit_gathers_the_same_statistics_as_collect_stats_and_prunes(tmp_path):
    data = batches(6)
    callback = ExpertPruning(PruningStrategy(ratio=0.5), output_dir=str(tmp_path / "run"))
    module = WithValidation("tiny:olmoe")
    # Validation (sanity check and a run after every batch) must not add to the statistics.
    trainer(callbacks=[callback], num_sanity_val_steps=2, val_check_interval=1).fit(module, DataLoader(data, batch_size=2))

    reference = tiny_model("olmoe")
    expected = ompmoe.collect_stats(reference, DataLoader(data, batch_size=2))
    assert_stats_equal(callback.stats, expected)
    plan = ompmoe.plan_pruning(expected, 0.5)
    assert [layer.kept for layer in callback.plan.layers] == [layer.kept for layer in plan.layers]
    ompmoe.prune(reference, plan)
    probe = data[0]["input_ids"][None]
    with torch.no_grad():
        torch.testing.assert_close(module.model(probe).logits, reference(probe).logits, rtol=0, atol=0)
        loaded = ompmoe.load_pruned(tmp_path / "run" / "model")
        torch.testing.assert_close(loaded(probe).logits, reference(probe).logits, rtol=0, atol=0)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        ".ompmoe-output", "model", "plan.json", "plots", "stats.safetensors"
    ]
    assert ompmoe.PruningPlan.load(tmp_path / "run" / "plan.json") == callback.plan
    assert not module.model.training


def test_validate_before_fit_says_that_nothing_was_pruned_and_after_fit_runs_the_pruned_model(tmp_path):
    callback = ExpertPruning(PruningStrategy(ratio=0.5))
    module = WithValidation("tiny:olmoe")
    loop = trainer(callbacks=[callback])
    with pytest.warns(UserWarning) as warned:
        loop.validate(module)
    assert [str(each.message) for each in warned if "ExpertPruning" in str(each.message)] == [
        "ExpertPruning prunes during trainer.fit (it calibrates on the fit's batches); trainer.validate runs the model "
        "as it is, unpruned. Call trainer.fit first, or load a model it pruned with ompmoe.load_pruned."]
    assert ompmoe.find_moe_layers(module.model)[0].num_experts == 16
    loop.fit(module, DataLoader(batches(2), batch_size=2))
    import warnings

    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        loop.validate(module)
    assert not [each for each in later if "ExpertPruning" in str(each.message)]
    kept = [layer.num_kept for layer in callback.plan.layers]
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(module.model)] == kept and sum(kept) < 16 * len(kept)


def test_padding_tokens_are_not_counted():
    block = batches(1, seq_len=48)[0]
    padded = {"input_ids": block["input_ids"].clone(), "attention_mask": block["attention_mask"].clone()}
    padded["attention_mask"][40:] = 0
    callback = ExpertPruning(PruningStrategy(ratio=0.5))
    trainer(callbacks=[callback]).fit(CalibrationModule("tiny:qwen3_moe"), DataLoader([padded], batch_size=1))
    expected = ompmoe.collect_stats(tiny_model("qwen3_moe"), [block["input_ids"][:40]])
    assert_stats_equal(callback.stats, expected, rtol=1e-5)


def test_metrics_reach_the_logger():
    class Recorder(DummyLogger):
        def __init__(self):
            super().__init__()
            self.logged = {}

        def log_metrics(self, metrics, step=None):
            self.logged.update(metrics)

    logger = Recorder()
    callback = ExpertPruning(PruningStrategy(ratio=0.5))
    trainer(callbacks=[callback], logger=logger).fit(CalibrationModule("tiny:mixtral"), DataLoader(batches(2)))
    plan = callback.plan
    assert logger.logged["ompmoe/achieved_ratio"] == pytest.approx(plan.achieved_ratio)
    for layer in plan.layers:
        assert logger.logged[f"ompmoe/{layer.name}/kept"] == layer.num_kept
        assert logger.logged[f"ompmoe/{layer.name}/residual"] == pytest.approx(layer.residual[layer.num_kept])


def test_bad_input_stops_before_the_calibration_pass(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    counter = ForwardCounter()
    with pytest.raises(OutputExistsError, match=r"already exists; pass --overwrite \(overwrite=True in Python\)"):
        trainer([ExpertPruning(output_dir=str(existing)), counter]).fit(
            CalibrationModule("tiny:qwen3_moe"), DataLoader(batches(2))
        )
    with pytest.raises(InfeasibleBudgetError, match=r"use a ratio in \[0.1250, 0.6250\]"):
        trainer([counter, ExpertPruning(PruningStrategy(ratio=0.9), output_dir=str(tmp_path / "new"))]).fit(
            CalibrationModule("tiny:qwen3_moe"), DataLoader(batches(2))
        )
    assert counter.calls == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]

    class NoModel(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return None

    with pytest.raises(AttributeError, match="ExpertPruning found no Hugging Face MoE model on NoModel"):
        trainer([ExpertPruning()]).fit(NoModel(), DataLoader(batches(2)))


class CheckpointThenCrash(pl.Callback):
    def __init__(self, path, save_after: int):
        self.path, self.save_after = path, save_after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.save_after:
            trainer.save_checkpoint(self.path)
        if batch_idx == self.save_after + 1:
            raise RuntimeError("simulated crash")


def test_statistics_survive_checkpoint_and_resume(tmp_path):
    data = ResumableDataLoader(batches(6), batch_size=1)
    full = ExpertPruning(PruningStrategy(ratio=0.5))
    trainer([full]).fit(CalibrationModule("tiny:qwen2_moe"), data)

    ckpt = tmp_path / "mid.ckpt"
    first = ExpertPruning(PruningStrategy(ratio=0.5))
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer([first, CheckpointThenCrash(ckpt, save_after=2)]).fit(
            CalibrationModule("tiny:qwen2_moe"), ResumableDataLoader(batches(6), batch_size=1)
        )
    assert first.stats is None  # the crashed fit never pruned

    resumed = ExpertPruning(PruningStrategy(ratio=0.5))
    trainer([resumed]).fit(
        CalibrationModule("tiny:qwen2_moe"), ResumableDataLoader(batches(6), batch_size=1), ckpt_path=str(ckpt)
    )
    assert_stats_equal(resumed.stats, full.stats)
    assert [layer.kept for layer in resumed.plan.layers] == [layer.kept for layer in full.plan.layers]


def test_resuming_with_a_plain_dataloader_warns(tmp_path):
    ckpt = tmp_path / "mid.ckpt"
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer([ExpertPruning(), CheckpointThenCrash(ckpt, save_after=0)]).fit(
            CalibrationModule("tiny:mixtral"), DataLoader(batches(3))
        )
    with pytest.warns(UserWarning, match="Resuming a calibration fit with a DataLoader that has no state_dict"):
        trainer([ExpertPruning()]).fit(CalibrationModule("tiny:mixtral"), DataLoader(batches(3)), ckpt_path=str(ckpt))


def run_distributed(tmp_path: Path, mode: str, num_blocks: int, model_type: str, loss_aware: bool = False) -> Path:
    out = tmp_path / mode
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(TESTS / "distributed_fit.py"), str(out), mode, str(num_blocks), model_type]
        + (["loss_aware"] if loss_aware else []),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded; same kernels give the same bits
    yield
    torch.set_num_threads(threads)


def reference_stats(num_blocks: int, model_type: str, loss_aware: bool = False) -> tuple[torch.nn.Module, ompmoe.MoEStats]:
    sys.path.insert(0, str(TESTS))
    from distributed_fit import calibration_batches

    model = tiny_model(model_type)
    return model, ompmoe.collect_stats(model, calibration_batches(num_blocks), loss_aware=loss_aware)


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_statistics_equal_single_process(tmp_path, one_thread):
    # 7 blocks on 2 ranks: DistributedSampler pads one duplicate block, which must not count.
    out = run_distributed(tmp_path, "ddp", 7, "deepseek_v3")
    model, expected = reference_stats(7, "deepseek_v3")
    got = ompmoe.MoEStats.load(out / "stats.safetensors")
    assert got.num_tokens == 7 * 32
    assert_stats_equal(got, expected, rtol=1e-12)
    plan = ompmoe.plan_pruning(expected, 0.5, min_kept_fraction=0.25)
    assert ompmoe.PruningPlan.load(out / "plan.json").kept_by_layer() == plan.kept_by_layer()


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_loss_aware_statistics_equal_single_process(tmp_path, one_thread):
    """The loss-aware sums merge across two ranks exactly like one process (padding duplicate left out)."""
    out = run_distributed(tmp_path, "ddp", 5, "qwen3_moe", loss_aware=True)
    _, expected = reference_stats(5, "qwen3_moe", loss_aware=True)
    got = ompmoe.MoEStats.load(out / "stats.safetensors")
    assert got.layers[0].gram_loss is not None
    assert_stats_equal(got, expected, rtol=1e-9)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_loss_aware_statistics_equal_single_process(tmp_path, one_thread):
    """Under FSDP2 the backward to the routed outputs runs on sharded layers; the sums still equal one process."""
    out = run_distributed(tmp_path, "fsdp2", 6, "qwen3_moe", loss_aware=True)
    _, expected = reference_stats(6, "qwen3_moe", loss_aware=True)
    got = ompmoe.MoEStats.load(out / "stats.safetensors")
    assert got.layers[0].gram_loss is not None
    assert_stats_equal(got, expected, rtol=1e-9)


def test_loss_strategy_without_loss_aware_statistics_is_refused_before_calibration():
    callback = ExpertPruning(PruningStrategy(ratio=0.5, method="omp_normalized", allocation="loss"))
    with pytest.raises(ValueError) as error:
        trainer(callbacks=[callback]).fit(CalibrationModule("tiny:qwen3_moe"), DataLoader(batches(2), batch_size=2))
    assert str(error.value) == (
        "The strategy's allocation 'loss' needs loss-aware statistics, which this calibration would not collect: "
        "pass ExpertPruning(..., loss_aware=True)."
    )
    assert callback.stats is None


def test_loss_aware_fit_equals_collect_stats():
    data = batches(4)
    callback = ExpertPruning(PruningStrategy(ratio=0.5), loss_aware=True)
    module = CalibrationModule("tiny:qwen3_moe")
    trainer(callbacks=[callback]).fit(module, DataLoader(data, batch_size=2))
    expected = ompmoe.collect_stats(tiny_model("qwen3_moe"), DataLoader(data, batch_size=2), loss_aware=True)
    assert callback.stats.layers[0].gram_fisher is not None
    assert_stats_equal(callback.stats, expected, rtol=1e-9)
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_model_parallel_strategy_prunes_the_gathered_model(tmp_path, one_thread):
    out = run_distributed(tmp_path, "fsdp2", 6, "qwen3_moe")
    model, expected = reference_stats(6, "qwen3_moe")
    got = ompmoe.MoEStats.load(out / "stats.safetensors")
    assert_stats_equal(got, expected, rtol=1e-6)
    plan = ompmoe.plan_pruning(expected, 0.5, min_kept_fraction=0.25)
    assert ompmoe.PruningPlan.load(out / "plan.json").kept_by_layer() == plan.kept_by_layer()
    ompmoe.prune(model, plan)
    probe = token_blocks(byte_tokens(shipped_text()), 32, 1)
    with torch.no_grad():
        torch.testing.assert_close(ompmoe.load_pruned(out / "model")(probe).logits, model(probe).logits)


def test_the_tokenizer_is_saved_with_the_pruned_model(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{chr(c): i + 1 for i, c in enumerate(range(97, 123))}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path / "tok")

    callback = ExpertPruning(PruningStrategy(ratio=0.5), output_dir=str(tmp_path / "run"))
    module = CalibrationModule("tiny:qwen3_moe", tokenizer=str(tmp_path / "tok"))
    trainer([callback]).fit(module, DataLoader(batches(2)))
    saved = AutoTokenizer.from_pretrained(tmp_path / "run" / "model")
    assert saved("abc")["input_ids"] == [1, 2, 3]
    loaded = ompmoe.load_pruned(tmp_path / "run" / "model")
    assert ompmoe.pruning_info(loaded)["kept_experts"] == callback.plan.kept_by_layer()


def test_fsdp1_strategy_is_refused_with_the_fsdp2_alternative():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    fake_trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ValueError, match=r"use ModelParallelStrategy\(data_parallel_size=N"):
        ExpertPruning().setup(fake_trainer, None, "fit")
    ExpertPruning().setup(fake_trainer, None, "validate")  # only calibration fits are affected


@pytest.mark.parametrize(
    "bad_batch, message",
    [
        ({"input_ids": torch.full((2, 8), 300)}, "input_ids hold token id 300"),
        ({"input_ids": torch.ones(2, 8, dtype=torch.long), "attention_mask": torch.full((2, 8), 7)},
         "attention_mask must hold only 0 and 1"),
    ],
)
def test_callback_refuses_bad_batches_before_the_forward(tmp_path, bad_batch, message):
    counter = ForwardCounter()
    callback = ExpertPruning(PruningStrategy(ratio=0.5), output_dir=None)
    with pytest.raises(ompmoe.CalibrationInputError, match=message):
        trainer(callbacks=[counter, callback]).fit(CalibrationModule("tiny:olmoe"), DataLoader([bad_batch], batch_size=None))
    assert counter.calls == 0
    assert not (tmp_path / "run").exists()


def test_missing_model_is_a_user_error_with_one_line_in_the_cli():
    from ompmoe.callbacks.pruning import MissingModelError, find_hf_model

    with pytest.raises(MissingModelError, match="found no Hugging Face MoE model") as caught:
        find_hf_model(torch.nn.Linear(2, 2))
    assert isinstance(caught.value, ValueError)  # `ompmoe fit` prints it as one `error:` line


class OwnModule(pl.LightningModule):
    """A user's own LightningModule: a model and nothing else (no tokenizer attributes)."""

    def __init__(self):
        super().__init__()
        self.model = tiny_model("olmoe")

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.model(**batch)

    def configure_optimizers(self):
        return None


class OwnData(pl.LightningDataModule):
    def __init__(self, tokenizer=None):
        super().__init__()
        self.tokenizer = tokenizer

    def train_dataloader(self):
        return DataLoader(batches(2))


def word_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{chr(c): i + 1 for i, c in enumerate(range(97, 123))}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(path)
    return path


def test_own_module_saves_the_data_modules_or_the_explicit_tokenizer_and_warns_without_one(tmp_path):
    from transformers import AutoTokenizer

    from ompmoe.engine.export.checkpoint import MissingTokenizerWarning

    tok = word_tokenizer(tmp_path / "tok")
    callback = ExpertPruning(PruningStrategy(ratio=0.5, allocation="uniform"), output_dir=str(tmp_path / "from-data"),
                             plots=False)
    trainer([callback]).fit(OwnModule(), datamodule=OwnData(tokenizer=str(tok)))
    assert AutoTokenizer.from_pretrained(tmp_path / "from-data" / "model")("abc")["input_ids"] == [1, 2, 3]

    callback = ExpertPruning(PruningStrategy(ratio=0.5, allocation="uniform"), output_dir=str(tmp_path / "explicit"),
                             plots=False, tokenizer=str(tok))
    trainer([callback]).fit(OwnModule(), datamodule=OwnData())
    assert AutoTokenizer.from_pretrained(tmp_path / "explicit" / "model")("cab")["input_ids"] == [3, 1, 2]

    callback = ExpertPruning(PruningStrategy(ratio=0.5, allocation="uniform"), output_dir=str(tmp_path / "none"),
                             plots=False)
    with pytest.warns(MissingTokenizerWarning, match=r"callback: ExpertPruning\(tokenizer=\.\.\.\)"):
        trainer([callback]).fit(OwnModule(), datamodule=OwnData())
    assert not (tmp_path / "none" / "model" / "tokenizer.json").exists()
    assert (tmp_path / "none" / "model" / "README.md").is_file()


def test_a_dense_model_held_as_self_model_is_named_as_dense_not_as_missing():
    from transformers import LlamaConfig, LlamaForCausalLM

    from ompmoe.callbacks.pruning import MissingModelError, find_hf_model

    class DenseModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                      num_hidden_layers=1, num_attention_heads=2))

    with pytest.raises(MissingModelError) as caught:
        find_hf_model(DenseModule())
    supported = ", ".join(ompmoe.supported_model_types())
    assert str(caught.value) == (
        "ExpertPruning: DenseModule.model: model LlamaForCausalLM has no MoE layers: ompmoe prunes the routed experts "
        f"of Mixture-of-Experts models; pass a model whose model_type is one of {supported} (e.g. shipped:tiny-moe or "
        "tiny:qwen3_moe)")


class UserModule(pl.LightningModule):
    """A user's own module, as docs/usage.md writes one: the model as ``self.model``, a forward per batch."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        self.model(**batch)

    def configure_optimizers(self):
        return None


def test_a_users_module_in_train_mode_calibrates_in_eval_mode_and_gets_its_mode_back(tmp_path):
    """Lightning puts the module in train mode, where Mixtral's router jitters (and dropout drops): the callback's
    statistics were 16-35 % off collect_stats' (which runs eval mode) and the plan differed. Now they are equal and the
    model's train mode is back after each batch."""
    model = tiny_model("mixtral", router_jitter_noise=0.5).train()
    data = batches(4)
    modes: list[bool] = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            modes.append(pl_module.model.training)

    callback = ExpertPruning(PruningStrategy(ratio=0.5, method="omp", allocation="uniform"), plots=False,
                             compensation="off")
    trainer(callbacks=[callback, Watch()]).fit(UserModule(model), DataLoader(data, batch_size=2))
    expected = ompmoe.collect_stats(tiny_model("mixtral", router_jitter_noise=0.5), DataLoader(data, batch_size=2))
    assert_stats_equal(callback.stats, expected)
    assert modes == [True, True]


def test_a_spawning_strategy_is_refused_before_calibration(tmp_path, one_thread):
    """ddp_spawn ran the whole job in the spawned processes, then crashed in the main one: Lightning loads the pruned
    rank 0's weights back into the unpruned model. Refused in setup, with the strategy that works."""
    callback = ExpertPruning(PruningStrategy(ratio=0.5), output_dir=str(tmp_path / "run"))
    with pytest.raises(Exception, match="ExpertPruning cannot run under strategy=DDPStrategy started by 'spawn'"):
        trainer([callback], devices=2, strategy="ddp_spawn").fit(CalibrationModule("tiny:olmoe"),
                                                                 DataLoader(batches(4), batch_size=1))
    assert not (tmp_path / "run").exists()


def test_options_given_the_wrong_way_are_refused_when_the_callback_is_made():
    """``ExpertPruning("run")`` was accepted and failed inside trainer.fit ('str' object has no attribute 'validate');
    ``ExpertPruning(ratio=0.5)`` said only that RunOptions got an unexpected keyword. Each names the fix now."""
    cases = [((("run",), {}), "strategy must be a Strategy such as ompmoe.PruningStrategy(ratio=0.5) (any object "
                              "with validate and plan); got str 'run' (a path? output_dir is a keyword option: "
                              "output_dir=...)."),
             ((({"ratio": 0.5},), {}), "strategy must be a Strategy such as ompmoe.PruningStrategy(ratio=0.5) (any "
                                       "object with validate and plan); got dict {'ratio': 0.5}."),
             (((), {"ratio": 0.5}), "ExpertPruning takes ratio in its strategy: "
                                    "ExpertPruning(strategy=ompmoe.PruningStrategy(ratio=...))."),
             (((), {"outputdir": "x"}), "ExpertPruning has no option 'outputdir'; its options: strategy, output_dir, "
                                        "overwrite, save_model, extra_ratios, plots, adaptive_epsilon, tokenizer, "
                                        "dtype, loss_aware, reroute, statistics, evaluate_on, evaluate_blocks, "
                                        "choice_blocks, compensation, layer_by_layer (ompmoe.RunOptions).")]
    for (args, kwargs), message in cases:
        with pytest.raises(TypeError) as refused:
            ExpertPruning(*args, **kwargs)
        assert str(refused.value) == message
    with pytest.raises(TypeError, match=r"^FabricCalibration takes method in its strategy: FabricCalibration\("):
        from types import SimpleNamespace

        ompmoe.FabricCalibration(SimpleNamespace(strategy=None), tiny_model("qwen3_moe"), method="omp")


def test_more_than_one_epoch_is_said_to_count_every_batch_again():
    """``max_epochs=3`` counted the data three times without a word (Lightning's default without max_epochs is 1000)."""
    callback = ExpertPruning(PruningStrategy(ratio=0.5))
    with pytest.warns(UserWarning) as caught:
        trainer([callback], max_epochs=3).fit(CalibrationModule("tiny:olmoe"), DataLoader(batches(2), batch_size=1))
    assert ("ExpertPruning counts every batch of every epoch: max_epochs=3 runs the calibration data 3 times, counting "
            "each batch again each time (no new information, that many times the time). Set Trainer(max_epochs=1), "
            "as configs/*.yaml do.") in [str(warning.message) for warning in caught]
    assert callback.stats.num_tokens == 3 * 2 * 32
