"""The fine-tuning recipe: best validation state kept, default training text, the documented CLI parses."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

import ompmoe
from ompmoe.data import corpus_token_stream, resolve_shipped, token_blocks
from ompmoe.lightning.finetune_data import FinetuneDataModule, default_source, shipped_origin

RECIPES = Path(__file__).parents[2] / "docs" / "recipes.md"


def tiny_fit(learning_rate: float, max_steps: int, **trainer_kwargs):
    torch.manual_seed(0)
    module = ompmoe.FinetuneModule("tiny:qwen3_moe", learning_rate=learning_rate)
    data = FinetuneDataModule("shipped:mix", tokenizer="bytes", seq_len=32, num_blocks=4, batch_size=2, val_blocks=2)
    module.configure_model()
    start = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         **trainer_kwargs)
    return module, data, trainer, start


def mean_validation_loss(module, data) -> float:
    """Literal: each validation set's block-weighted mean loss, then the mean over the sets."""
    module.eval()
    means = []
    with torch.no_grad():
        for loader in data.val_dataloader():
            parts = [(module.compute_loss(b).lm_loss.item(), b["input_ids"].shape[0]) for b in loader]
            means.append(sum(loss * n for loss, n in parts) / sum(n for _, n in parts))
    module.train()
    return sum(means) / len(means)


def test_a_fit_that_worsens_validation_restores_the_starting_model_and_says_so():
    module, data, trainer, start = tiny_fit(learning_rate=1.0, max_steps=2)  # lr 1.0 wrecks the model
    data.setup("fit")
    before = mean_validation_loss(module, data)
    with pytest.warns(UserWarning) as caught:
        trainer.fit(module, data)
    history = module.validation_history
    assert [step for step, _ in history] == [0, 2] and history[0][1] == pytest.approx(before, rel=1e-6)
    assert history[1][1] > history[0][1]
    messages = [str(w.message) for w in caught if str(w.message).startswith("FinetuneModule")]
    assert messages == [f"FinetuneModule: restored the best validation state, the starting model (before training): "
                        f"mean validation loss {history[0][1]:.4f}; the final state (step 2) had {history[1][1]:.4f}."]
    for name, parameter in module.model.named_parameters():
        assert torch.equal(parameter, start[name]), name
    assert mean_validation_loss(module, data) == pytest.approx(before, rel=1e-6)


def test_the_best_intermediate_state_is_restored_when_later_ones_are_worse():
    module, data, trainer, _ = tiny_fit(learning_rate=1e-3, max_steps=4, val_check_interval=1)
    snapshots = {}

    class Snapshot(pl.Callback):  # the weights at every validation, to compare the restored ones with
        def on_validation_epoch_end(self, trainer, pl_module):
            snapshots[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}

    trainer.callbacks.append(Snapshot())

    def worse_after_step_2(mean: float, original=module._candidate) -> None:
        step = int(trainer.global_step)
        original(mean + (10.0 if step > 2 else 0.0))  # states after step 2 look worse

    module._candidate = worse_after_step_2
    with pytest.warns(UserWarning, match=re.escape("restored the best validation state, step ")):
        trainer.fit(module, data)
    best_step = min(module.validation_history, key=lambda item: item[1])[0]
    assert 0 < best_step <= 2
    for name, parameter in module.model.named_parameters():
        assert torch.equal(parameter, snapshots[best_step][name]), name


def test_an_improving_fit_keeps_its_final_state_without_a_warning(recwarn):
    module, data, trainer, start = tiny_fit(learning_rate=1e-2, max_steps=3)
    data.val_sources = ["shipped:mix"]  # validate on the training text: it must improve
    data.val_blocks = 4
    trainer.fit(module, data)
    assert module.validation_history[-1][1] < module.validation_history[0][1]
    assert not [w for w in recwarn if str(w.message).startswith("FinetuneModule")]
    assert any(not torch.equal(p, start[n]) for n, p in module.model.named_parameters())


def test_shipped_models_and_models_pruned_from_them_default_to_the_train_split(tmp_path):
    pruned = tmp_path / "pruned"
    pruned.mkdir()
    (pruned / "config.json").write_text(json.dumps({"ompmoe": {"plan": {"model_id": "shipped:tiny-moe-64"}}}))
    assert shipped_origin("shipped:tiny-moe") == "shipped:tiny-moe"
    assert shipped_origin(str(pruned)) == "shipped:tiny-moe-64"
    assert default_source(str(pruned)) == default_source("shipped:tiny-moe") == "train:mix"
    with pytest.raises(ValueError) as error:
        default_source("tiny:qwen3_moe")
    assert str(error.value) == (
        "FinetuneDataModule has no default training text for 'tiny:qwen3_moe' (only shipped models have one: "
        "train:mix). Pass source=<local file, hub data set or preset>, text disjoint from the data you evaluate on.")

    # Attached to a module of the shipped model, source=None reads the train split, half from each domain.
    from transformers import AutoTokenizer

    data = FinetuneDataModule(tokenizer="shipped:tiny-moe", seq_len=16, num_blocks=4)
    data.trainer = SimpleNamespace(lightning_module=ompmoe.FinetuneModule("shipped:tiny-moe"))
    data.setup("fit")
    assert data.source == "train:mix" and data.describe() == (
        "shipped:ompmoe/data/corpus/prose-train,shipped:ompmoe/data/corpus/code-train")
    tokenizer = AutoTokenizer.from_pretrained(resolve_shipped("shipped:tiny-moe"))
    prose, code = (token_blocks(corpus_token_stream(tokenizer, d, "train", max_tokens=32), 16, 2) for d in ("prose", "code"))
    assert torch.equal(data.blocks, torch.stack([prose[0], code[0], prose[1], code[1]]))


def test_source_none_without_a_module_is_refused():
    data = FinetuneDataModule(tokenizer="bytes", seq_len=16, num_blocks=2)
    with pytest.raises(ValueError) as error:
        data.setup("fit")
    assert str(error.value) == ("FinetuneDataModule(source=None) takes its training text from the model: attach it "
                                "to a Trainer with a FinetuneModule, or pass source=.")


def documented_cli_args() -> list[str]:
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", RECIPES.read_text(), re.DOTALL)
                if "ompmoe.lightning.finetune_module fit" in b]
    words = shlex.split(" ".join(line.rstrip("\\") for line in block.splitlines()), comments=True)
    start = words.index("ompmoe.lightning.finetune_module") + 1
    end = words.index("python", start) if "python" in words[start:] else len(words)
    return words[start:end]


def test_the_documented_cli_recipe_parses(capsys):
    from ompmoe.lightning.finetune_module import main

    args = documented_cli_args()
    with pytest.raises(SystemExit) as done:
        main([*args, "--print_config"])
    assert done.value.code in (0, None)
    import yaml

    config = yaml.safe_load(capsys.readouterr().out)
    model, data, trainer = config["model"], config["data"], config["trainer"]
    flags = dict(zip(args[1::2], args[2::2]))
    assert model["learning_rate"] == float(flags["--model.learning_rate"])
    assert model["lora_rank"] == int(flags.get("--model.lora_rank", 0))
    assert model["teacher"] == flags["--model.teacher"] == "shipped:tiny-moe"
    assert model["distill_weight"] == float(flags["--model.distill_weight"])
    assert model["keep_best"] is True and data["val_sources"] == ["shipped:prose", "shipped:code"]
    assert data["num_blocks"] == int(flags["--data.num_blocks"]) and data["seq_len"] == int(flags["--data.seq_len"])
    assert data["source"] is None and "--data.source" not in flags  # the default: train:mix for this model
    assert trainer["max_epochs"] == int(flags["--trainer.max_epochs"])


def literal_mean_token_kl(first: torch.Tensor, second: torch.Tensor, mask: torch.Tensor | None) -> float:
    """Literal, in float64: mean over the real tokens (``mask`` 1; all tokens without one) of
    ``KL(first || second) = sum_v P_first(v) * (log P_first(v) - log P_second(v))`` of the next-token distributions."""
    log_p = torch.log_softmax(first.double(), dim=-1)
    log_q = torch.log_softmax(second.double(), dim=-1)
    per_token = []
    for row in range(first.shape[0]):
        for position in range(first.shape[1]):
            if mask is None or mask[row, position] == 1:
                p, q = log_p[row, position].tolist(), log_q[row, position].tolist()
                per_token.append(sum(math.exp(p[v]) * (p[v] - q[v]) for v in range(first.shape[-1])))
    return sum(per_token) / len(per_token)


def test_distillation_loss_is_the_mean_token_kl_to_the_teacher():
    """KL(teacher || student) per real token, padding left out, mean over the real tokens (the documented loss);
    the teacher differs from the student (another seed, a sharper LM head) so every wrong variant gives another
    value: the reverse KL, the mean over padding too, a teacher that does not see the padding mask, the sum."""
    from ompmoe.engine.tiny import tiny_model

    student, teacher = tiny_model("qwen3_moe", seed=0), tiny_model("qwen3_moe", seed=1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(20.0)  # a peaked teacher: KL(t || s) and KL(s || t) are far apart
    teacher_state = {name: p.clone() for name, p in teacher.state_dict().items()}
    module = ompmoe.FinetuneModule(student, teacher=teacher, distill_weight=0.25)
    module.configure_model()
    torch.manual_seed(0)
    ids = torch.randint(3, student.config.vocab_size, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0  # right padding
    mask[1, :3] = 0  # left padding: the teacher's real tokens differ when it does not see the mask
    batch = {"input_ids": ids, "attention_mask": mask}
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, attention_mask=mask).logits
        teacher_unmasked = teacher(input_ids=ids).logits
    student_logits = student(input_ids=ids, attention_mask=mask).logits.detach().requires_grad_(True)

    expected = literal_mean_token_kl(teacher_logits, student_logits.detach(), mask)
    wrong = {
        "KL(student || teacher)": literal_mean_token_kl(student_logits.detach(), teacher_logits, mask),
        "mean over padding too": literal_mean_token_kl(teacher_logits, student_logits.detach(), None),
        "teacher without the mask": literal_mean_token_kl(teacher_unmasked, student_logits.detach(), mask),
        "sum over tokens": expected * int(mask.sum()),
    }
    loss = module.distillation_loss(batch, student_logits)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    for name, value in wrong.items():
        assert abs(value - expected) > 1e-4 * expected, name  # ten times the tolerance
        assert loss.item() != pytest.approx(value, rel=1e-5), name
    # The gradient reaches the student's logits: d KL / d logits = (softmax(student) - P_teacher) / real tokens.
    loss.backward()
    gradient = (torch.softmax(student_logits.detach().double(), -1) - torch.softmax(teacher_logits.double(), -1))
    gradient = gradient * mask[..., None] / mask.sum()
    torch.testing.assert_close(student_logits.grad.double(), gradient, atol=1e-7, rtol=1e-4)
    # Without an attention mask every token counts (and the teacher sees no mask either).
    with torch.no_grad():
        plain = student(input_ids=ids).logits
    assert module.distillation_loss({"input_ids": ids}, plain).item() == pytest.approx(
        literal_mean_token_kl(teacher_unmasked, plain, None), rel=1e-5)
    for name, p in teacher.state_dict().items():  # the teacher is only read
        assert torch.equal(p, teacher_state[name]), name
    assert all(p.grad is None for p in teacher.parameters())

    lm = module.compute_loss(batch).lm_loss
    module.log = lambda *args, **kwargs: None  # no trainer attached
    assert module.training_step(batch, 0).item() == pytest.approx((0.75 * lm + 0.25 * expected).item(), rel=1e-5)
    itself = ompmoe.FinetuneModule(teacher, teacher=teacher)
    assert itself.distillation_loss(batch, teacher_logits).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError) as error:
        ompmoe.FinetuneModule(student, teacher=teacher, distill_weight=1.5)
    assert str(error.value) == "distill_weight must lie in [0, 1]; got 1.5."


def test_a_best_state_naming_parameters_the_model_no_longer_has_is_refused_not_reported():
    module = ompmoe.FinetuneModule("tiny:qwen3_moe")
    module.configure_model()
    module._trainer = SimpleNamespace(global_step=5)  # the end of a fit whose best validation was the start
    module.validation_history = [(0, 0.5), (5, 1.0)]
    module._best = (0, 0.5, {"model.renamed.weight": torch.zeros(1)})
    with pytest.raises(RuntimeError) as error:
        module.on_train_end()
    assert str(error.value) == ("FinetuneModule: the best validation state names parameters the model no longer has: "
                                "model.renamed.weight.")
