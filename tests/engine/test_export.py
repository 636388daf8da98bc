"""Pruned checkpoints in stock tools: remote code for non-uniform plans, refusal without it, complete directories.

The stock-tool checks run in a subprocess where importing ompmoe is impossible (a meta-path
blocker, ``python -I`` and a working directory outside the repository), the way a user without
ompmoe would load a checkpoint downloaded from the hub.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors import safe_open

import ompmoe
from ompmoe.engine.adapters import ARCHITECTURES, find_moe_layers
from ompmoe.engine.export.checkpoint import MissingTokenizerWarning
from ompmoe.engine.export.config import load_tokenizer
from ompmoe.engine.export.hub_code import CONFIG_FILE, HOW_TO_LOAD, MODELING_FILE
from ompmoe.engine.tiny import tiny_model

HERE = Path(__file__).resolve().parents[1]  # tests/
INPUT_IDS = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(7))
SHIPPED = Path(ompmoe.__file__).parent / "data" / "tiny-moe"
MODEL_TYPES = sorted(ARCHITECTURES)

BLOCKED_PRELUDE = r'''
import importlib.abc, json, sys

class _NoOmpmoe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ompmoe" or name.startswith("ompmoe."):
            raise ImportError("ompmoe is not installed in this environment (test blocker)")
        return None

sys.meta_path.insert(0, _NoOmpmoe())
try:
    import ompmoe  # noqa: F401
    raise SystemExit("ompmoe was importable")
except ImportError:
    pass
import os, torch, transformers
torch.set_num_threads(int(os.environ["PARENT_TORCH_THREADS"]))  # the same CPU kernels give the same bits
'''

STOCK_LOAD_SCRIPT = BLOCKED_PRELUDE + r'''
directories, inputs, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
input_ids = torch.load(inputs)
text = "def f(x):\n    return x + 1\n"
results = {}
for name, directory in directories.items():
    entry = {"ompmoe_in_modules": any(m == "ompmoe" or m.startswith("ompmoe.") for m in sys.modules)}
    entry["stock"] = json.load(open(f"{directory}/config.json"))["architectures"][0]
    # Before any stock model class is built here: transformers caches per class whether the experts
    # implementation can be set, and the stock class's cached answer would hide the remote class's.
    implementations = {}
    for variant, kwargs in {"float32": {}, "bfloat16": {"dtype": torch.bfloat16},
                            "batched_mm": {"experts_implementation": "batched_mm"}}.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, **kwargs)
        implementations[variant] = model.config._experts_implementation
        with torch.no_grad():
            torch.save(model(input_ids).logits, f"{out}/{name}-{variant}.pt")
    model.set_experts_implementation("eager")
    implementations["set_eager"] = model.config._experts_implementation
    with torch.no_grad():
        torch.save(model(input_ids).logits, f"{out}/{name}-set_eager.pt")
    entry["implementations"] = implementations
    model.save_pretrained(f"{out}/{name}-resaved")  # stock save_pretrained copies the remote code
    entry["class"] = type(model).__name__
    entry["counts"] = {n: int(m.experts.num_experts) for n, m in model.named_modules()
                       if hasattr(m, "experts") and hasattr(getattr(m, "experts"), "num_experts")}
    entry["tokens"] = transformers.AutoTokenizer.from_pretrained(directory)(text)["input_ids"]  # no remote code
    refusals = {}
    attempts = {
        "auto": lambda: transformers.AutoModelForCausalLM.from_pretrained(directory),
        "auto_ignore_mismatched": lambda: transformers.AutoModelForCausalLM.from_pretrained(
            directory, ignore_mismatched_sizes=True),
        "stock_class_ignore_mismatched": lambda: getattr(transformers, entry["stock"]).from_pretrained(
            directory, ignore_mismatched_sizes=True),
        "from_stock_config": lambda: transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(directory)),
        "auto_eager": lambda: transformers.AutoModelForCausalLM.from_pretrained(
            directory, experts_implementation="eager"),
    }
    for how, attempt in attempts.items():
        try:
            attempt()
            refusals[how] = None
        except Exception as error:  # what a user would see
            refusals[how] = f"{type(error).__name__}: {error}"
    entry["refusals"] = refusals
    results[name] = entry
json.dump(results, open(f"{out}/results.json", "w"))
'''

LM_EVAL_SCRIPT = BLOCKED_PRELUDE + r'''
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

directory, tasks_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
tokenizer = transformers.AutoTokenizer.from_pretrained(directory)  # reads config.json too; no remote code
lm = HFLM(pretrained=directory, trust_remote_code=True, batch_size=4, device="cpu", dtype="float32")
result = simple_evaluate(model=lm, tasks=["tiny_mc"], bootstrap_iters=0, log_samples=True,
                         task_manager=TaskManager(include_path=tasks_dir, include_defaults=False))
json.dump({
    "class": type(lm.model).__name__,
    "tokenizer_vocab": len(tokenizer),
    "results": result["results"]["tiny_mc"],
    "loglikelihoods": [[r[0] for r in s["filtered_resps"]] for s in result["samples"]["tiny_mc"]],
}, open(f"{out}/lm_eval.json", "w"), default=str)
'''


def run_blocked(script: str, *args: str, cwd: Path) -> None:
    """Run ``script`` with ompmoe unimportable, outside the repository, offline, with its own module cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(cwd / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PARENT_TORCH_THREADS=str(torch.get_num_threads()))
    (cwd / "script.py").write_text(script)
    done = subprocess.run([sys.executable, "-I", "script.py", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


def non_uniform_plan(model: torch.nn.Module) -> ompmoe.PruningPlan:
    """A real plan whose layers keep different counts (equal per group for group-limited routers)."""
    stats = ompmoe.collect_stats(model, [INPUT_IDS])
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="uniform")
    for i, (layer_plan, layer) in enumerate(zip(plan.layers, find_moe_layers(model))):
        size = layer.num_experts // layer.num_groups
        per_group = size // 2 + (i % 2)
        if layer.num_groups == 1:
            per_group = max(per_group, layer.top_k)
        layer_plan.kept = [g * size + j for g in range(layer.num_groups) for j in range(per_group)]
    assert len({len(layer.kept) for layer in plan.layers}) > 1
    return plan


VARIANTS = {  # what the subprocess loads with trust_remote_code=True -> the same load_pruned arguments
    "float32": {}, "bfloat16": {"dtype": torch.bfloat16}, "batched_mm": {"experts_implementation": "batched_mm"},
    "set_eager": {"experts_implementation": "eager"},
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """Non-uniform checkpoints of every architecture, and what stock transformers did with them without ompmoe."""
    root = tmp_path_factory.mktemp("exported")
    directories, expected, counts = {}, {}, {}
    for model_type in MODEL_TYPES:
        model = tiny_model(model_type)
        ompmoe.prune(model, non_uniform_plan(model))
        directories[model_type] = str(ompmoe.save_pruned(model, root / model_type, tokenizer=str(SHIPPED)))
        for variant, kwargs in VARIANTS.items():
            with torch.no_grad():
                expected[model_type, variant] = ompmoe.load_pruned(root / model_type, **kwargs)(INPUT_IDS).logits
        counts[model_type] = {name: len(ids) for name, ids in ompmoe.pruning_info(model)["kept_experts"].items()}
    torch.save(INPUT_IDS, root / "inputs.pt")
    work = root / "stock"
    work.mkdir()
    run_blocked(STOCK_LOAD_SCRIPT, json.dumps(directories), str(root / "inputs.pt"), str(work), cwd=work)
    return {"root": root, "expected": expected, "counts": counts,
            "results": json.loads((work / "results.json").read_text()), "work": work}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_non_uniform_checkpoint_loads_with_remote_code_without_ompmoe(exported, model_type):
    result = exported["results"][model_type]
    assert result["ompmoe_in_modules"] is False
    stock = result["stock"]
    assert result["class"] == f"OmpmoePruned{stock}"
    assert result["counts"] == exported["counts"][model_type]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_remote_code_runs_the_stock_experts_kernels_bit_for_bit(exported, model_type):
    """Same default as the stock classes (grouped_mm), both ways of choosing another, logits equal load_pruned's."""
    result = exported["results"][model_type]
    assert result["implementations"] == {
        "float32": "grouped_mm", "bfloat16": "grouped_mm", "batched_mm": "batched_mm", "set_eager": "eager"}
    for variant in VARIANTS:
        logits = torch.load(exported["work"] / f"{model_type}-{variant}.pt")
        expected = exported["expected"][model_type, variant]
        assert logits.dtype == expected.dtype == (torch.bfloat16 if variant == "bfloat16" else torch.float32)
        assert torch.equal(logits, expected), (variant, (logits.float() - expected.float()).abs().max())


@pytest.mark.parametrize("model_type", ["olmoe", "glm4_moe"])
def test_stock_save_pretrained_of_the_remote_model_keeps_refusing_stock_classes(exported, model_type):
    resaved = exported["work"] / f"{model_type}-resaved"
    config = json.loads((resaved / "config.json").read_text())
    original = json.loads((exported["root"] / model_type / "config.json").read_text())
    assert config["experts_implementation"] == HOW_TO_LOAD and config["auto_map"] == original["auto_map"]
    assert config["architectures"] == original["architectures"]  # the stock class, not the remote one
    assert (resaved / MODELING_FILE).read_text() == (exported["root"] / model_type / MODELING_FILE).read_text()
    with torch.no_grad():
        logits = ompmoe.load_pruned(resaved)(INPUT_IDS).logits
    assert torch.equal(logits, exported["expected"][model_type, "float32"])


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tokenizer_of_a_non_uniform_checkpoint_loads_without_remote_code(exported, model_type):
    source = transformers.AutoTokenizer.from_pretrained(SHIPPED)
    assert exported["results"][model_type]["tokens"] == source("def f(x):\n    return x + 1\n")["input_ids"]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_non_uniform_checkpoint_is_refused_by_every_stock_path_with_both_ways_named(exported, model_type):
    refusals = exported["results"][model_type]["refusals"]
    assert set(refusals) == {"auto", "auto_ignore_mismatched", "stock_class_ignore_mismatched", "from_stock_config",
                             "auto_eager"}
    for how, message in refusals.items():
        assert message is not None, f"{how} loaded the non-uniform checkpoint without remote code"
        if how == "auto_eager":  # the refusing value overridden by hand: the largest count fits no smaller layer
            assert message == ("RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an error. "
                               "For details look at the above report!")
            continue
        assert message.startswith("ValueError: Specified `experts_implementation=")
        assert HOW_TO_LOAD in message, (how, message)
        assert "trust_remote_code=True" in message and "ompmoe.load_pruned(path)" in message


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_non_uniform_directory_layout(exported, model_type):
    directory = exported["root"] / model_type
    config = json.loads((directory / "config.json").read_text())
    per_layer = exported["counts"][model_type]
    assert config["experts_implementation"] == HOW_TO_LOAD
    stock = config["architectures"][0]
    assert config["auto_map"] == {
        "AutoConfig": f"configuration_ompmoe_pruned.OmpmoePruned{stock.removesuffix('ForCausalLM')}Config",
        "AutoModelForCausalLM": f"modeling_ompmoe_pruned.OmpmoePruned{stock}",
    }
    counts = {k: v for k, v in config.items() if isinstance(v, int) and "expert" in k and "per_tok" not in k
              and "shared" not in k}
    assert counts == {count_json_key(model_type): max(per_layer.values())}  # one count, the largest layer's
    for name in (CONFIG_FILE, MODELING_FILE):
        source = (directory / name).read_text()
        imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
        assert imports and all(line.split()[1] in {"copy", "torch", "transformers", ".configuration_ompmoe_pruned"}
                               for line in imports), imports
    card = (directory / "README.md").read_text()
    assert "trust_remote_code=True" in card and "ompmoe.load_pruned" in card


def count_json_key(model_type: str) -> str:
    """The ``config.json`` key of a causal LM's expert count (Qwen3-MoE stores ``num_experts`` as
    ``num_local_experts``)."""
    key = ARCHITECTURES[model_type].expert_count_key
    return transformers.CONFIG_MAPPING[model_type].attribute_map.get(key, key)


def count_mapping_format(directory: Path) -> None:
    """Rewrite a non-uniform checkpoint as ompmoe wrote them before ``experts_implementation`` refused stock
    classes: the expert count was a mapping under the config attribute's name, stock-refused by its type."""
    config = json.loads((directory / "config.json").read_text())
    key = ARCHITECTURES[config["model_type"]].expert_count_key
    per_layer = {name: len(ids) for name, ids in config["ompmoe"]["kept_experts"].items()}
    del config["experts_implementation"], config[count_json_key(config["model_type"])]
    config[key] = {"how_to_load": HOW_TO_LOAD, "max": max(per_layer.values()), "per_layer": per_layer}
    (directory / "config.json").write_text(json.dumps(config))


def old_format(directory: Path) -> None:
    """Rewrite a new non-uniform checkpoint as ompmoe wrote them before remote code: int count, no code."""
    config = json.loads((directory / "config.json").read_text())
    del config["experts_implementation"], config["auto_map"]
    (directory / "config.json").write_text(json.dumps(config))
    (directory / CONFIG_FILE).unlink()
    (directory / MODELING_FILE).unlink()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_load_pruned_reads_current_checkpoints_and_refuses_the_count_mapping_clearly(exported, model_type, tmp_path):
    import shutil

    new, mapping, old = exported["root"] / model_type, tmp_path / "mapping", tmp_path / "old"
    for directory, rewrite in ((old, old_format), (mapping, count_mapping_format)):
        shutil.copytree(new, directory)
        rewrite(directory)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # what the old format did in stock tools
        transformers.AutoModelForCausalLM.from_pretrained(old)
    with pytest.raises(Exception, match="expected int, got dict"):  # and the count mapping
        transformers.AutoModelForCausalLM.from_pretrained(mapping)
    message = (f"{mapping} was pruned by an earlier ompmoe version (config.json stores "
               f"'{ARCHITECTURES[model_type].expert_count_key}' as a mapping), which this version does not read. "
               "Re-create it from the statistics of that run: ompmoe prune --stats STATS.safetensors --ratio R "
               "--model ORIGINAL_MODEL --output_dir NEW_DIR.")
    with pytest.raises(ValueError) as error:
        ompmoe.load_pruned(mapping)
    assert str(error.value) == message
    with pytest.raises(ValueError) as error:
        load_tokenizer(mapping)
    assert str(error.value) == message
    config = json.loads((mapping / "config.json").read_text())
    key = ARCHITECTURES[model_type].expert_count_key
    for broken in ({"per_layer": config[key]["per_layer"]}, {**config[key], "max": "many"}):  # no max; not a number
        (mapping / "config.json").write_text(json.dumps({**config, key: broken}))
        with pytest.raises(ValueError) as error:
            ompmoe.load_pruned(mapping)
        assert str(error.value) == message
    source = transformers.AutoTokenizer.from_pretrained(SHIPPED)
    for directory in (new, old):
        loaded = ompmoe.load_pruned(directory)
        assert type(loaded).__module__.startswith("transformers.models.")
        assert loaded.config._experts_implementation == "grouped_mm"
        assert "auto_map" not in loaded.config.to_dict() and "experts_implementation" not in loaded.config.to_dict()
        with torch.no_grad():
            assert torch.equal(loaded(INPUT_IDS).logits, exported["expected"][model_type, "float32"])
        assert load_tokenizer(directory).vocab == source.vocab


def test_resaving_a_loaded_non_uniform_model_writes_the_remote_code_again(exported, tmp_path):
    loaded = ompmoe.load_pruned(exported["root"] / "mixtral")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MissingTokenizerWarning)
        ompmoe.save_pruned(loaded, tmp_path / "again")
    assert (tmp_path / "again" / MODELING_FILE).read_text() == (exported["root"] / "mixtral" / MODELING_FILE).read_text()
    assert json.loads((tmp_path / "again" / "config.json").read_text())["auto_map"]
    with torch.no_grad():
        logits = ompmoe.load_pruned(tmp_path / "again")(INPUT_IDS).logits
    assert torch.equal(logits, exported["expected"]["mixtral", "float32"])


def test_uniform_checkpoint_is_plain_and_loads_without_remote_code(tmp_path):
    model = tiny_model("olmoe")
    stats = ompmoe.collect_stats(model, [INPUT_IDS])
    ompmoe.prune(model, ompmoe.plan_pruning(stats, 0.5, allocation="uniform"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MissingTokenizerWarning)
        ompmoe.save_pruned(model, tmp_path / "uniform")
    config = json.loads((tmp_path / "uniform" / "config.json").read_text())
    assert "auto_map" not in config and config["num_experts"] == 8
    assert not (tmp_path / "uniform" / MODELING_FILE).exists() and not (tmp_path / "uniform" / CONFIG_FILE).exists()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "uniform")
    assert type(plain) is type(model)
    with torch.no_grad():
        assert torch.equal(plain(INPUT_IDS).logits, model(INPUT_IDS).logits)


# --------------------------------------------------------------------------- shipped model: dtype, tokenizer, card,
# lm-eval


@pytest.fixture(scope="module")
def shipped_pruned(tmp_path_factory) -> dict:
    """The shipped bf16 model loaded in float32 (as calibration does), pruned non-uniformly and saved."""
    root = tmp_path_factory.mktemp("shipped")
    model = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    from ompmoe.data import shipped_text

    tokenizer = transformers.AutoTokenizer.from_pretrained(SHIPPED)
    batches = [torch.tensor([tokenizer(shipped_text()[i * 2000:(i + 1) * 2000])["input_ids"][:128]]) for i in range(4)]
    stats = ompmoe.collect_stats(model, batches, model_id="org/tiny-moe")  # a hub mirror, say: not what was loaded
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="waterfill")
    assert not plan.is_uniform
    with pytest.warns(UserWarning) as caught:
        ompmoe.prune(model, plan)
    assert [str(w.message) for w in caught] == [
        "The statistics were collected as 'org/tiny-moe' but the model pruned was loaded from 'shipped:tiny-moe'; "
        "the model card and config.json name 'shipped:tiny-moe'."]
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingTokenizerWarning)  # found from the model's source
        ompmoe.save_pruned(model, root / "bf16", calibration="shipped corpus (python docs and source)")
    return {"root": root, "model": model, "plan": plan, "stats": stats}


def test_weights_keep_the_source_dtype_unless_asked(shipped_pruned, tmp_path):
    root, model = shipped_pruned["root"], shipped_pruned["model"]
    assert next(model.parameters()).dtype == torch.float32
    with safe_open(str(root / "bf16" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((root / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert str(model.config.dtype).removeprefix("torch.") == "float32"  # the in-memory model is untouched
    assert next(model.parameters()).dtype == torch.float32
    loaded = ompmoe.load_pruned(root / "bf16")
    state = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name

    ompmoe.save_pruned(model, tmp_path / "f32", dtype="float32")
    with safe_open(str(tmp_path / "f32" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    assert (tmp_path / "f32" / "model.safetensors").stat().st_size > 1.9 * (root / "bf16" / "model.safetensors").stat().st_size
    with pytest.raises(ValueError, match=r"Unknown dtype 'int8' for the saved weights; use e.g. 'bfloat16'"):
        ompmoe.save_pruned(model, tmp_path / "bad", dtype="int8")
    assert not (tmp_path / "bad").exists()


def test_tokenizer_is_saved_from_the_source_or_argument_and_missing_one_warns(shipped_pruned, tmp_path):
    source = transformers.AutoTokenizer.from_pretrained(SHIPPED)
    saved = transformers.AutoTokenizer.from_pretrained(shipped_pruned["root"] / "bf16")
    text = "def f(x):\n    return x + 1\n"
    assert saved(text)["input_ids"] == source(text)["input_ids"] and len(saved) == len(source)

    tiny = tiny_model("mixtral")
    stats = ompmoe.collect_stats(tiny, [INPUT_IDS])
    ompmoe.prune(tiny, ompmoe.plan_pruning(stats, 0.5, allocation="uniform"))
    with pytest.warns(MissingTokenizerWarning, match=r"pass tokenizer=<hub id, path or tokenizer> to save_pruned") as record:
        ompmoe.save_pruned(tiny, tmp_path / "none")
    assert str(tmp_path / "none") in str(record[0].message)
    assert not (tmp_path / "none" / "tokenizer.json").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingTokenizerWarning)
        ompmoe.save_pruned(tiny, tmp_path / "by-path", tokenizer=str(SHIPPED))
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "by-path")(text)["input_ids"] == source(text)["input_ids"]
    with pytest.raises(ValueError, match=r"tokenizer='/nonexistent/tok' could not be loaded"):
        ompmoe.save_pruned(tiny, tmp_path / "bad", tokenizer="/nonexistent/tok")
    assert not (tmp_path / "bad").exists()


def test_a_source_without_tokenizer_files_gives_no_made_up_tokenizer(tmp_path):
    """transformers 5 builds an empty tokenizer from a folder without tokenizer files: the pruned model gets none (and
    the warning), never that one; named outright, it is refused, naming the folder."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_model("qwen3_moe").save_pretrained(tmp_path / "source")
    model = ompmoe.load_pruned(tmp_path / "source")
    stats = ompmoe.collect_stats(model, [INPUT_IDS])
    ompmoe.prune(model, ompmoe.plan_pruning(stats, 0.5, allocation="uniform"))
    with pytest.warns(MissingTokenizerWarning, match=r"No tokenizer was found for the pruned model"):
        ompmoe.save_pruned(model, tmp_path / "pruned")
    assert not (tmp_path / "pruned" / "tokenizer.json").exists()
    assert not (tmp_path / "pruned" / "tokenizer_config.json").exists()
    with pytest.raises(ValueError) as refused:
        ompmoe.save_pruned(model, tmp_path / "named", tokenizer=str(tmp_path / "source"))
    assert str(refused.value) == (
        f"tokenizer={str(tmp_path / 'source')!r} could not be loaded ({tmp_path / 'source'} has no tokenizer files "
        "(what loads from it is an empty vocabulary)); pass a hub id, a local directory with tokenizer files, or a "
        "tokenizer object.")
    assert not (tmp_path / "named").exists()


def test_the_saved_tokenizers_source_is_the_first_that_has_one_a_path_object_too(tmp_path):
    """The candidates a run hands ``usable_tokenizer`` (the option, then the model's and the data's): a path given as
    a ``Path`` counts as the same path as a string; a folder without tokenizer files (a checkpoint calibrated on bytes)
    is passed over; ``bytes`` and ``tiny:`` names never count."""
    from pathlib import Path

    from ompmoe.engine.export.checkpoint import usable_tokenizer

    (tmp_path / "empty").mkdir()
    assert usable_tokenizer([Path(SHIPPED), "org/other"]) == str(SHIPPED)
    assert usable_tokenizer([None, str(tmp_path / "empty"), "bytes", "tiny:qwen3_moe", str(SHIPPED)]) == str(SHIPPED)
    assert usable_tokenizer([None, tmp_path / "empty", "bytes"]) is None


def test_model_card_front_matter_and_contents(shipped_pruned):
    card = (shipped_pruned["root"] / "bf16" / "README.md").read_text()
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta == {  # the card names the model that was loaded: a shipped one is no hub id, so no base_model
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["ompmoe", "moe", "expert-pruning", "non-uniform-experts", "qwen3_moe", "custom_code"],
    }
    plan, stats = shipped_pruned["plan"], shipped_pruned["stats"]
    assert body.startswith("\n# shipped:tiny-moe, experts pruned with ompmoe\n\nBase model: `shipped:tiny-moe` (not a "
                           "Hugging Face Hub id, so no `base_model` above).\n\nStatistics collected as `org/tiny-moe`.\n")
    record = json.loads((shipped_pruned["root"] / "bf16" / "config.json").read_text())["ompmoe"]["plan"]
    assert (record["model_id"], record["statistics_model_id"]) == ("shipped:tiny-moe", "org/tiny-moe")
    assert "| Method | omp |" in body
    assert "| Requested ratio (experts removed) | 0.5 |" in body
    assert "| Allocation | waterfill |" in body
    assert "| Calibration data | shipped corpus (python docs and source) |" in body
    assert f"| Calibration tokens | {stats.num_tokens} |" in body
    assert "| Weights dtype | bfloat16 |" in body and "| Tokenizer included | yes |" in body
    kept = sum(layer.num_kept for layer in plan.layers)
    total = sum(layer.num_experts for layer in plan.layers)
    assert f"| Achieved ratio | {1 - kept / total:.4f} ({kept} of {total} routed experts kept) |" in body
    for layer in plan.layers:
        ids = ", ".join(map(str, sorted(layer.kept)))
        assert f"| `{layer.name}` | {layer.num_kept} | {layer.num_experts} | {ids} |" in body
    assert "round((1 - ratio) * N)" in body and "N - int(ratio * N)" in body
    assert 'from_pretrained("path/to/this/directory", trust_remote_code=True)' in body
    assert "pretrained=path/to/this/directory,trust_remote_code=True" in body
    assert 'AutoTokenizer.from_pretrained("path/to/this/directory")  # needs no remote code' in body


def test_the_card_of_a_hub_model_names_it_as_base_model_and_no_other_statistics(tmp_path):
    model = tiny_model("qwen3_moe")
    model.config._name_or_path = "org/tiny-moe"  # as from_pretrained("org/tiny-moe") records it
    stats = ompmoe.collect_stats(model, [INPUT_IDS])
    assert stats.model_id == "org/tiny-moe"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the statistics name the loaded model: no warning
        ompmoe.prune(model, ompmoe.plan_pruning(stats, 0.5, allocation="uniform"))
    ompmoe.save_pruned(model, tmp_path / "m", tokenizer=str(SHIPPED))
    _, front, body = (tmp_path / "m" / "README.md").read_text().split("---\n", 2)
    assert yaml.safe_load(front)["base_model"] == "org/tiny-moe"
    assert body.startswith("\n# tiny-moe, experts pruned with ompmoe\n\n| |") and "Statistics collected as" not in body


def test_lm_eval_hf_runs_on_the_non_uniform_checkpoint_without_ompmoe(shipped_pruned, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    directory = shipped_pruned["root"] / "bf16"
    run_blocked(LM_EVAL_SCRIPT, str(directory), str(HERE / "eval_tasks"), str(tmp_path), cwd=tmp_path)
    stock = json.loads((tmp_path / "lm_eval.json").read_text())
    assert stock["class"] == "OmpmoePrunedQwen3MoeForCausalLM"
    assert stock["tokenizer_vocab"] == len(transformers.AutoTokenizer.from_pretrained(SHIPPED))

    lm = HFLM(pretrained=ompmoe.load_pruned(directory, dtype=torch.float32), tokenizer=transformers.AutoTokenizer.from_pretrained(SHIPPED), batch_size=4,
              device="cpu")
    reference = simple_evaluate(model=lm, tasks=["tiny_mc"], bootstrap_iters=0, log_samples=True,
                                task_manager=TaskManager(include_path=str(HERE / "eval_tasks"), include_defaults=False))
    expected = [[r[0] for r in s["filtered_resps"]] for s in reference["samples"]["tiny_mc"]]
    expected = json.loads(json.dumps(expected, default=str))
    assert len(expected) == len(stock["loglikelihoods"]) == 14
    for ours, theirs in zip(expected, stock["loglikelihoods"]):  # across processes: equal up to CPU kernel noise
        assert [float(x) for x in ours] == pytest.approx([float(x) for x in theirs], rel=1e-6, abs=1e-5)
    for metric in ("acc,none", "acc_norm,none"):
        assert stock["results"][metric] == reference["results"]["tiny_mc"][metric]


def test_a_non_uniform_checkpoint_of_more_than_ten_moe_layers_loads(tmp_path):
    """config.json stores the record with sorted keys (``layers.10`` before ``layers.2``): loading matches layers by
    name, in ompmoe and in the remote code, whatever their order there."""
    model = tiny_model("qwen3_moe", num_hidden_layers=12)
    stats = ompmoe.collect_stats(model, [INPUT_IDS], progress=False)
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="waterfill")
    pruned = ompmoe.prune(model, plan)
    assert not ompmoe.pruning_info(pruned)["uniform"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ompmoe.save_pruned(pruned, tmp_path / "model")
    record = json.loads((tmp_path / "model" / "config.json").read_text())["ompmoe"]["kept_experts"]
    assert list(record) != [layer.name for layer in plan.layers]  # stored out of the model's order
    rows = [line.split("`")[1] for line in (tmp_path / "model" / "README.md").read_text().splitlines()
            if line.startswith("| `model.layers.")]
    assert rows == [layer.name for layer in plan.layers]  # the card lists them in the model's order
    for reloaded in (ompmoe.load_pruned(tmp_path / "model"),
                     transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", trust_remote_code=True)):
        with torch.no_grad():
            torch.testing.assert_close(reloaded(INPUT_IDS).logits, pruned(INPUT_IDS).logits, rtol=0, atol=0)
