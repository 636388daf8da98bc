"""A multimodal checkpoint whose container class cannot run in the installed transformers (Llama 4 as released, whose
``Llama4ForConditionalGeneration`` fails on every forward) is read as its text model, as ``AutoModelForCausalLM``
reads it, with a warning that says so, resident and layer by layer alike; what ompmoe writes is that text model."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import ompmoe
from ompmoe.engine.export.weights import CheckpointWeightsError
from ompmoe.engine.model_classes import TextModelInsteadWarning
from ompmoe.engine.tiny import tiny_model

IDS = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(1))
BLOCKS = torch.randint(3, 250, (4, 16), generator=torch.Generator().manual_seed(2)).split(2)


def container_checkpoint(path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_model("llama4").save_pretrained(path)
    return str(path)


def test_a_llama4_checkpoint_loads_as_its_text_model_with_the_warning_and_no_loading_report(tmp_path, capfd):
    path = container_checkpoint(tmp_path / "llama4")
    capfd.readouterr()
    with pytest.warns(TextModelInsteadWarning) as caught:
        model = ompmoe.load_pruned(path)
    assert str(caught[0].message) == (
        f"{path} is a Llama4ForConditionalGeneration, which fails on every forward in transformers "
        f"{transformers.__version__} (it reads image_outputs, which its language model's output does not have): "
        "ompmoe reads its text model, Llama4ForCausalLM, from the same files (as AutoModelForCausalLM does) and "
        "writes that, without the vision tower.")
    assert "LOAD REPORT" not in capfd.readouterr().err  # the vision tower's tensors are not listed one by one
    assert type(model).__name__ == "Llama4ForCausalLM" and model.config.model_type == "llama4_text"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


def test_a_text_tensor_missing_from_the_files_is_still_refused(tmp_path):
    path = container_checkpoint(tmp_path / "llama4")
    tensors = load_file(f"{path}/model.safetensors")
    removed = next(name for name in tensors if name.endswith("layers.0.feed_forward.router.weight"))
    del tensors[removed]
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointWeightsError, match=r"does not match the model: tensors missing \(would be random\): "
                                                     r"model\.layers\.0\.feed_forward\.router\.weight"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ompmoe.load_pruned(path)


def test_a_text_tensor_the_model_does_not_have_is_still_refused(tmp_path):
    """Only the vision tower's tensors may be left over: one more decoder layer's tensor under the text model is not
    in the model, and refused as in any checkpoint."""
    path = container_checkpoint(tmp_path / "llama4")
    tensors = load_file(f"{path}/model.safetensors")
    extra = "language_model.model.layers.7.feed_forward.router.weight"
    tensors[extra] = next(tensor for name, tensor in tensors.items()
                          if name.endswith("feed_forward.router.weight")).clone()
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointWeightsError, match=rf"does not match the model: tensors not in the model: {extra}"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ompmoe.load_pruned(path)


def test_the_warning_is_given_once_per_checkpoint_and_a_silent_read_does_not_count(tmp_path):
    from ompmoe.engine.model_classes import runnable_config

    path = container_checkpoint(tmp_path / "llama4")
    config = transformers.AutoConfig.from_pretrained(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert runnable_config(config, warn=False).model_type == "llama4_text"  # the CLI's check before loading
        runnable_config(config)
        runnable_config(config)
    assert [w.category for w in caught] == [TextModelInsteadWarning]


def test_layer_by_layer_reads_the_text_model_and_writes_what_the_resident_run_writes(tmp_path):
    path = container_checkpoint(tmp_path / "llama4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resident = ompmoe.load_pruned(path)
        stats = ompmoe.collect_stats(resident, BLOCKS, progress=False)
        layered = ompmoe.collect_stats_layerwise(path, BLOCKS)
    assert layered.model_type == stats.model_type == "llama4_text"
    for ours, theirs in zip(layered.layers, stats.layers):
        torch.testing.assert_close(ours.gram, theirs.gram, rtol=1e-5, atol=1e-9)
    plan = ompmoe.plan_pruning(layered, 0.5, allocation="waterfill")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ompmoe.save_pruned_from_files(path, plan, tmp_path / "streamed")
        ompmoe.save_pruned(ompmoe.prune(resident, plan), tmp_path / "resident")
    streamed, written = load_file(tmp_path / "streamed" / "model.safetensors"), \
        load_file(tmp_path / "resident" / "model.safetensors")
    assert sorted(streamed) == sorted(written) and {name.split(".")[0] for name in streamed} == {"model", "lm_head"}
    for name, tensor in written.items():
        assert torch.equal(streamed[name], tensor), name
    reloaded = ompmoe.load_pruned(tmp_path / "streamed")
    assert type(reloaded).__name__ == "Llama4ForCausalLM"
    for written_by in ("streamed", "resident"):  # the card says what was left out
        assert (f"This is the text model of `{path}`, whose multimodal class cannot run in transformers "
                f"{transformers.__version__}: ompmoe read and pruned its text model, and the vision tower is not in "
                "this checkpoint.") in (tmp_path / written_by / "README.md").read_text()
    assert ompmoe.pruning_info(reloaded)["kept_experts"] == plan.kept_by_layer()


@pytest.mark.filterwarnings("ignore:No tokenizer was found")
@pytest.mark.parametrize("layer_by_layer", ["true", "false"])
def test_ompmoe_fit_prunes_a_llama4_checkpoint_as_its_text_model(layer_by_layer, tmp_path):
    """The whole default job (auto's trial and refit) on the checkpoint's files, resident and layer by layer: the
    warning once, the plan, and a Llama4ForCausalLM written."""
    from ompmoe.cli import main

    from test_cli import tiny_config

    path = container_checkpoint(tmp_path / "llama4")
    with pytest.warns(TextModelInsteadWarning) as caught:
        main(["fit", "-c", str(tiny_config(tmp_path)), "--model.model", path, "--data.tokenizer", "bytes",
              "--layer_by_layer", layer_by_layer, "--trainer.enable_progress_bar=false"])
    told = [str(w.message) for w in caught if w.category is TextModelInsteadWarning]
    assert len(told) == 1 and told[0].startswith(f"{path} is a Llama4ForConditionalGeneration"), told
    plan = ompmoe.PruningPlan.load(tmp_path / "run" / "plan.json")
    model = ompmoe.load_pruned(tmp_path / "run" / "model")
    assert type(model).__name__ == "Llama4ForCausalLM"
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(model)] == [layer.num_kept for layer in plan.layers]


def test_a_quantized_containers_unconverted_modules_are_named_as_in_its_text_model(tmp_path):
    """transformers matches ``modules_to_not_convert`` against the model's own module names: the text model's have no
    ``language_model.`` before them (the vision tower's entries stay, matching nothing)."""
    from ompmoe.engine.model_classes import runnable_config

    config = transformers.AutoConfig.from_pretrained(container_checkpoint(tmp_path / "llama4"))
    config.quantization_config = {"quant_method": "fbgemm_fp8", "modules_to_not_convert": [
        "language_model.model.layers.0.feed_forward.router", "vision_model", "language_model.lm_head"]}
    text = runnable_config(config, warn=False)
    assert text.quantization_config["modules_to_not_convert"] == [
        "model.layers.0.feed_forward.router", "vision_model", "lm_head"]
    assert config.quantization_config["modules_to_not_convert"][0].startswith("language_model.")  # a copy changed
