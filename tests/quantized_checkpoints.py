"""What the tests of quantized checkpoints (block FP8, MXFP4, compressed-tensors) share: writing a checkpoint's files
beside its config, changing them in place, the logits stock transformers gives in a fresh process, and the refusal of
a named compensation by both commands."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def write_checkpoint(source: Path, target: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """``target``: ``source``'s files other than its weights (tokenizer, generation config), ``tensors`` in one
    safetensors file and ``config`` as its config.json."""
    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.name not in ("model.safetensors.index.json", "config.json"):
            shutil.copy(path, target / path.name)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def rewrite(directory: Path, change) -> None:
    """``change(tensors, config)`` applied to the checkpoint's files and config.json in place."""
    tensors, config = read_tensors(directory), json.loads((directory / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))


def logits_in_a_fresh_process(path: Path, ids: torch.Tensor, scratch: Path, remote_code: bool) -> torch.Tensor:
    """The logits of stock ``AutoModelForCausalLM.from_pretrained(path)`` (with ``trust_remote_code`` if
    ``remote_code``) for ``ids``, in a process that never imports ompmoe."""
    ids_file, out_file = str(scratch / "ids.pt"), str(scratch / "out.pt")
    torch.save(ids, ids_file)
    load = f"transformers.AutoModelForCausalLM.from_pretrained(path{', trust_remote_code=True' if remote_code else ''})"
    script = (f"import sys, torch, transformers\npath = {str(path)!r}\nmodel = {load}\n"
              f"assert 'ompmoe' not in sys.modules\nwith torch.no_grad():\n"
              f"    torch.save(model(torch.load({ids_file!r})).logits, {out_file!r})")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(out_file)


def assert_both_commands_refuse_a_named_compensation(source: Path, stats: Path, tmp_path: Path, capsys,
                                                     stored: str) -> str:
    """``ompmoe fit --layer_by_layer true`` and ``ompmoe prune --model`` of ``source`` (``stored``: its format as
    messages name it) with ``--compensation down``: refused before any work, with the fix, nothing written.
    Returns the refusal as the Python API words it."""
    from ompmoe.cli import main

    from test_cli import tiny_config

    (tmp_path / "again").mkdir()
    capsys.readouterr()
    try:
        main(["fit", "-c", str(tiny_config(tmp_path / "again")), "--trainer.enable_progress_bar=false",
              "--layer_by_layer", "true", "--model.model", str(source), "--compensation", "down"])
    except SystemExit:
        pass
    else:
        raise AssertionError("ompmoe fit --compensation down was not refused")
    assert not (tmp_path / "again" / "run").exists()
    refusal = (f"{source} stores {stored} weights, which ompmoe writes as stored; a compensation changes the kept "
               "experts' weights, which would have to be quantized again (ompmoe quantizes again block-FP8 weights "
               "whose scale_fmt is none, 'float' or 'ue8m0', MXFP4 and compressed-tensors integer and FP8 ones). "
               "Prune it with {off} (the paper's setting), or compensate its full-precision checkpoint.")
    assert refusal.format(off="compensation='off'") in capsys.readouterr().err
    try:
        main(["prune", "--stats", str(stats), "--ratio", "0.25", "--model", str(source), "--output_dir",
              str(tmp_path / "again" / "pruned"), "--compensation", "down"])
    except SystemExit:
        pass
    else:
        raise AssertionError("ompmoe prune --compensation down was not refused")
    assert refusal.format(off="--compensation off") in capsys.readouterr().err
    assert not (tmp_path / "again" / "pruned").exists()
    return refusal.format(off="compensation='off'")


def assert_stock_transformers_reads_it_pruned(source: Path, dequantized: Path, stats, ids: torch.Tensor,
                                              tmp_path: Path) -> dict[str, Path]:
    """``source`` (quantized) pruned at 0.5 from its files, uniformly and per layer (``tmp_path/<allocation>``): stock
    transformers (the remote code for per-layer counts), in a fresh process, gives the logits of ``dequantized``
    (the full-precision checkpoint it stands for) pruned by the same plan, exactly. Returns the written checkpoints."""
    import warnings

    import ompmoe
    from ompmoe.engine.export.streamed import save_pruned_from_files

    written = {}
    for allocation in ("uniform", "waterfill"):
        plan = ompmoe.plan_pruning(stats, 0.5, allocation=allocation)
        assert plan.achieved_ratio == 0.5
        written[allocation] = save_pruned_from_files(source, plan, tmp_path / allocation)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pruned = ompmoe.prune(ompmoe.load_pruned(dequantized), plan)
            with torch.no_grad():
                expected = pruned(ids).logits
        logits = logits_in_a_fresh_process(written[allocation], ids, tmp_path, remote_code=allocation != "uniform")
        assert torch.equal(logits, expected), allocation
    return written


def assert_pruned_layer_by_layer_as_resident(source: Path, dequantized: Path, blocks: list, tmp_path: Path,
                                             tokenizer: str | None = None, quantization_config: dict | None = None):
    """The layer-by-layer statistics of ``source`` (quantized) equal the resident pass on ``dequantized`` (the
    full-precision checkpoint it stands for), with the same plan at 0.5 (``waterfill``); both pruned checkpoints are
    written, ``save_pruned``'s to ``tmp_path/resident`` and the files' to ``tmp_path/streamed``, whose config is
    ``save_pruned``'s plus the source's ``quantization_config`` (or ``quantization_config``: a container's, renamed
    for its text model). Returns the plan."""
    import warnings

    import ompmoe
    from ompmoe.engine.collect.layerwise import collect_stats_layerwise
    from ompmoe.engine.export.streamed import save_pruned_from_files

    from test_layerwise import assert_same_statistics

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ompmoe.load_pruned(dequantized)
        resident = ompmoe.collect_stats(model, blocks, progress=False)
        layered = collect_stats_layerwise(source, blocks, progress=False)
        assert_same_statistics(resident, layered)  # the dequantized checkpoint's, as the resident pass gives them
        plan = ompmoe.plan_pruning(layered, 0.5, allocation="waterfill")
        assert plan.kept_by_layer() == ompmoe.plan_pruning(resident, 0.5, allocation="waterfill").kept_by_layer()
        ompmoe.save_pruned(ompmoe.prune(model, plan), tmp_path / "resident", tokenizer=tokenizer)
        save_pruned_from_files(source, plan, tmp_path / "streamed", tokenizer=tokenizer)
    config = json.loads((tmp_path / "streamed" / "config.json").read_text())
    assert config.pop("quantization_config") == (
        quantization_config or json.loads((source / "config.json").read_text())["quantization_config"])
    resident = json.loads((tmp_path / "resident" / "config.json").read_text())
    for each in (config, resident):  # the checkpoint each was read from (the resident one: the dequantized)
        del each["ompmoe"]["plan"]["model_id"]
        each["ompmoe"]["plan"].pop("statistics_model_id", None)
    assert config == resident
    return plan


def compensated_layer_by_layer(source: Path, blocks: list[torch.Tensor], granularity: str, tmp_path: Path):
    """``source`` (quantized) planned at 0.5 from its statistics on ``blocks``, compensated (``granularity``, fitted
    on ``blocks``) and measured on held-out tokens layer by layer, then written from its files to
    ``tmp_path/written``. Returns (plan, held-out tokens, the measures)."""
    import ompmoe
    from ompmoe.engine.apply.layer_by_layer import measure_layer_by_layer
    from ompmoe.engine.collect.layerwise import collect_stats_layerwise
    from ompmoe.engine.export.config import load_stock_config
    from ompmoe.engine.export.streamed import save_pruned_from_files
    from ompmoe.engine.lazy_checkpoint import build_skeleton, checkpoint_dtype

    plan = ompmoe.plan_pruning(collect_stats_layerwise(source, blocks, progress=False), 0.5, allocation="waterfill")
    heldout = torch.randint(3, 250, (4, 16), generator=torch.Generator().manual_seed(7))
    config = load_stock_config(source)
    (tmp_path / "scratch").mkdir()
    measured = measure_layer_by_layer(source, build_skeleton(config, dtype=checkpoint_dtype(config)), plan,
                                      tmp_path / "scratch", granularity=granularity, text=torch.cat(blocks),
                                      heldout={"set": heldout}, progress=False)
    assert measured.compensation is not None
    save_pruned_from_files(source, plan, tmp_path / "written", compensation=measured.compensation)
    return plan, heldout, measured


def fit_layer_by_layer(source: Path, tmp_path: Path, caplog) -> tuple[list[str], object]:
    """``ompmoe fit -c`` the tiny config ``--layer_by_layer true`` on the checkpoint ``source``: its ``ompmoe:`` lines
    and the plan it wrote (``tmp_path / "run"``)."""
    import ompmoe
    from ompmoe.cli import main

    from test_cli import tiny_config

    caplog.set_level("INFO")
    main(["fit", "-c", str(tiny_config(tmp_path)), "--trainer.enable_progress_bar=false", "--layer_by_layer", "true",
          "--model.model", str(source)])
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("ompmoe")]
    return lines, ompmoe.PruningPlan.load(tmp_path / "run" / "plan.json")

