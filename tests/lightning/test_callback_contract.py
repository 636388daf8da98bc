"""ExpertPruning with a user's own LightningModule and DataLoader (README, Lightning): the batches it accepts, the one
line that refuses the others at the first batch, and calibration that refuses to plan from weights that changed."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ompmoe
from ompmoe import PruningStrategy
from ompmoe.callbacks import ExpertPruning
from ompmoe.engine.collect.collector import WeightsChangedError
from ompmoe.engine.methods.loss.statistics import LossAwareError
from ompmoe.engine.tiny import tiny_model

from reference import ForwardCounter, batches, trainer

pytestmark = [pytest.mark.filterwarnings("ignore:`LightningModule.configure_optimizers` returned `None`"),
              pytest.mark.filterwarnings("ignore:`training_step` returned `None`"),
              pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode")]

CONTRACT = ("a tensor of input_ids, a dict with input_ids, or a tuple/list (input_ids[, attention_mask]) of "
            "tensors")


def assert_stats_equal(a: ompmoe.MoEStats, b: ompmoe.MoEStats) -> None:
    assert a.num_tokens == b.num_tokens
    for la, lb in zip(a.layers, b.layers, strict=True):
        for key, value in la.tensors().items():
            torch.testing.assert_close(value, lb.tensors()[key], rtol=0, atol=0)


def token_ids(num_blocks: int = 4) -> torch.Tensor:
    return torch.stack([block["input_ids"] for block in batches(num_blocks)])


class UserModule(pl.LightningModule):
    """A practitioner's own module: the MoE as ``self.model``, the next-token loss, AdamW when ``optimizer`` is given
    (its options), nothing else ompmoe knows about. Batches are unpacked as the user's data gives them."""

    def __init__(self, optimizer: dict | None = None, no_grad: bool = False, returns_loss: bool = False):
        super().__init__()
        self.model = tiny_model("olmoe")
        self.optimizer, self.no_grad, self.returns_loss = optimizer, no_grad, returns_loss

    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict):
            ids, mask = batch.get("input_ids", batch.get("tokens")), batch.get("attention_mask", batch.get("pad"))
        elif isinstance(batch, (tuple, list)):
            ids, mask = batch[0], batch[1] if len(batch) > 1 else None
        else:
            ids, mask = batch, None
        with torch.set_grad_enabled(not self.no_grad):
            loss = self.model(input_ids=ids, attention_mask=mask, labels=ids).loss
        return loss if self.optimizer is not None or self.returns_loss else None

    def configure_optimizers(self):
        if self.optimizer is None:
            return None
        return torch.optim.AdamW(self.parameters(), lr=1e-3, **self.optimizer)


def fit(loader: DataLoader, module: pl.LightningModule | None = None, **options) -> ExpertPruning:
    callback = ExpertPruning(PruningStrategy(ratio=0.5), plots=False, save_model=False, **options)
    trainer([callback]).fit(module or UserModule(), loader)
    return callback


def test_tensor_dataset_list_batches_give_the_statistics_and_plan_of_tensor_batches(tmp_path):
    ids = token_ids()
    as_tensors = fit(DataLoader(ids, batch_size=2), output_dir=str(tmp_path / "tensors"))
    as_lists = fit(DataLoader(TensorDataset(ids), batch_size=2), output_dir=str(tmp_path / "lists"))
    assert_stats_equal(as_lists.stats, as_tensors.stats)
    assert as_lists.stats.num_tokens == ids.numel()
    assert as_lists.plan.kept_by_layer() == as_tensors.plan.kept_by_layer()
    assert (ompmoe.PruningPlan.load(tmp_path / "lists" / "plan.json").kept_by_layer()
            == as_tensors.plan.kept_by_layer())


def test_a_tuple_batch_honours_its_attention_mask():
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[:, 20:] = 0  # right padding: 20 of 32 tokens count
    as_tuples = fit(DataLoader(TensorDataset(ids, mask), batch_size=2))
    as_dicts = fit(DataLoader([{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask)], batch_size=2))
    assert as_tuples.stats.num_tokens == int(mask.sum()) == 4 * 20
    assert_stats_equal(as_tuples.stats, as_dicts.stats)


def test_batch_to_inputs_maps_a_batch_of_the_users_own_format():
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[:, 24:] = 0
    own = [{"tokens": i, "pad": m} for i, m in zip(ids, mask)]
    mapped = fit(DataLoader(own, batch_size=2),
                 batch_to_inputs=lambda batch: {"input_ids": batch["tokens"], "attention_mask": batch["pad"]})
    as_dicts = fit(DataLoader([{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask)], batch_size=2))
    assert mapped.stats.num_tokens == 4 * 24
    assert_stats_equal(mapped.stats, as_dicts.stats)


@pytest.mark.parametrize("data, got", [
    (["some text"], "str"),
    ([{"labels": torch.zeros(2, 8, dtype=torch.long)}], "dict with keys ['labels'] (labels: tensor (2, 8))"),
    ([(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, dtype=torch.long))],
     "list of 2 (tensor (2, 8), tensor (2,))"),  # (ids, labels): no mask, not guessed at
    ([(torch.full((2, 8), 5), torch.full((2, 8), -100))],
     "list of 2 (tensor (2, 8), tensor (2, 8))"),  # labels shaped like the ids are no 0/1 mask either
])
def test_a_batch_outside_the_contract_is_refused_in_one_line_at_the_first_batch(tmp_path, data, got):
    counter = ForwardCounter()
    callback = ExpertPruning(PruningStrategy(ratio=0.5), output_dir=str(tmp_path / "run"))
    with pytest.raises(ompmoe.CalibrationInputError) as error:
        trainer([counter, callback]).fit(UserModule(), DataLoader(data, batch_size=None))
    assert str(error.value) == (
        f"ExpertPruning: a batch must be {CONTRACT}; got {got}. Pass ExpertPruning(batch_to_inputs=fn), with "
        "fn(batch) returning {'input_ids': ..., 'attention_mask': ...}, to map yours.")
    assert counter.calls == 0
    assert not (tmp_path / "run").exists()


def test_batch_to_inputs_that_returns_something_else_is_refused_in_one_line():
    counter = ForwardCounter()
    callback = ExpertPruning(PruningStrategy(ratio=0.5), batch_to_inputs=lambda batch: batch["text"])
    with pytest.raises(ompmoe.CalibrationInputError) as error:
        trainer([counter, callback]).fit(UserModule(), DataLoader([{"text": "abc"}], batch_size=None))
    assert str(error.value) == (
        f"ExpertPruning: batch_to_inputs must return {CONTRACT}; it returned str for a batch of dict with keys "
        "['text'] (text: str).")
    assert counter.calls == 0
    with pytest.raises(ValueError, match="^ExpertPruning: batch_to_inputs must be a function from a batch to "):
        ExpertPruning(batch_to_inputs="input_ids")


def changed_message(name: str) -> str:
    return (f"ExpertPruning: the model's weights changed during calibration ({name} changed after the first "
            "calibration batch, as an optimizer step does), so the statistics mix several models; no plan was made "
            "and nothing was written. Calibrate in a loop that does not step an optimizer (in a Trainer: a "
            "LightningModule without optimizers, such as ompmoe.CalibrationModule, or frozen weights), then prune "
            "the trained model in a run of its own.")


@pytest.mark.parametrize("num_blocks, optimizer", [
    (4, {}),  # refused at the second batch (the step bumped the version counters), before more forwards
    (2, {"fused": True}),  # fused AdamW bumps no counter: refused at the end, by the weights' values
    (1, {}),  # one batch, one step after it: refused at the end
], ids=["steps-between-batches", "fused-adamw", "step-after-the-only-batch"])
def test_a_training_step_that_steps_adamw_is_refused_and_writes_nothing(tmp_path, num_blocks, optimizer):
    module = UserModule(optimizer=optimizer)
    first = next(module.model.parameters()).detach().clone()
    callback = ExpertPruning(PruningStrategy(ratio=0.5), output_dir=str(tmp_path / "run"))
    with pytest.raises(WeightsChangedError) as error:
        trainer([callback]).fit(module, DataLoader(token_ids(num_blocks), batch_size=1))
    assert str(error.value) == changed_message("model.embed_tokens.weight")
    assert not torch.equal(next(module.model.parameters()), first)  # the user's AdamW did step
    assert callback.plan is None and callback.stats is None
    assert not (tmp_path / "run").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no reservation or temporary left either


def test_a_backward_without_an_optimizer_step_is_calibration(tmp_path):
    """Lightning runs the loss's backward (gradients, no step); loss-aware statistics run their own: no refusal."""
    module = UserModule(returns_loss=True)
    callback = fit(DataLoader(token_ids(), batch_size=2), module, loss_aware=True, output_dir=str(tmp_path / "run"))
    assert callback.stats.layers[0].gram_loss is not None
    assert next(module.model.parameters()).grad is not None  # Lightning's backward ran
    assert (tmp_path / "run" / "plan.json").is_file()


def test_auto_needs_gradients_through_the_users_forward():
    """``ExpertPruning()`` (``auto``: loss-aware statistics) calibrates a step that runs with gradients, and names
    the fix when the step wraps its forward in ``torch.no_grad``; the paper's method needs no gradients."""
    loader = DataLoader(token_ids(), batch_size=2)
    auto = ExpertPruning(plots=False)
    trainer([auto]).fit(UserModule(), loader)
    assert auto.stats.layers[0].gram_loss is not None
    with pytest.raises(LossAwareError, match=r"needs the forward to run with gradients enabled .*torch\.no_grad\(\)"):
        trainer([ExpertPruning(plots=False)]).fit(UserModule(no_grad=True), loader)
    paper = fit(loader, UserModule(no_grad=True))
    assert (paper.plan.method, paper.plan.allocation) == ("omp", "waterfill")
    assert paper.plan.extra.get("compensation") is None


def stepping(model: torch.nn.Module, blocks: torch.Tensor):
    """Calibration batches from a generator that trains ``model`` between them (AdamW on the next-token loss)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for block in blocks:
        yield block[None]
        model(input_ids=block[None], labels=block[None]).loss.backward()
        optimizer.step()


def test_every_front_door_refuses_statistics_from_changing_weights(tmp_path):
    from lightning.fabric import Fabric

    from ompmoe.lightning.fabric import FabricCalibration

    blocks = token_ids(2)
    ompmoe.collect_stats(tiny_model("olmoe"), stepping(tiny_model("olmoe"), blocks))  # another model trains: fine
    model = tiny_model("olmoe")
    with pytest.raises(WeightsChangedError) as error:
        ompmoe.collect_stats(model, stepping(model, blocks))
    assert str(error.value) == changed_message("model.embed_tokens.weight").replace("ExpertPruning", "collect_stats")

    fabric = Fabric(accelerator="cpu", devices=1)
    model = tiny_model("olmoe")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calibration = FabricCalibration(fabric, fabric.setup(model), PruningStrategy(ratio=0.5),
                                    output_dir=str(tmp_path / "run"), plots=False)
    for block in blocks:
        calibration.update(block[None])
        model(input_ids=block[None], labels=block[None]).loss.backward()
        optimizer.step()
    with pytest.raises(WeightsChangedError) as error:
        calibration.finish()
    assert str(error.value) == changed_message("model.embed_tokens.weight").replace("ExpertPruning",
                                                                                    "FabricCalibration")
    assert not (tmp_path / "run").exists()


def test_the_docs_own_module_example_runs(tmp_path, monkeypatch):
    """docs/usage.md's Lightning example of a user's own module and TensorDataset loader, run verbatim."""
    import re

    page = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text(encoding="utf-8")
    start = page.index("<!-- runs in: tests/lightning/test_callback_contract.py -->")
    code = re.compile(r"```python\n(.*?)```", re.DOTALL).search(page, start).group(1)
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []  # the callback's rank-zero lines, whatever logging state earlier tests left
    monkeypatch.setattr("ompmoe.callbacks.pruning.rank_zero_info", lines.append)
    exec(compile(code, "docs/usage.md", "exec"), {"__name__": "docs_usage"})
    assert lines[0].startswith("ompmoe: method omp_normalized, allocation loss, compensation down, ")
    assert ompmoe.PruningPlan.load(tmp_path / "own-run" / "plan.json").ratio == 0.5
