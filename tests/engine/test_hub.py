"""A hub id where the hub does not answer is read from the local cache alone: the hub libraries would retry each
file five times with back-off (about 23 s a file) before falling back to the cache. The cache here is a hub-snapshot
tree of the shipped model; the hub's answer is patched (no test touches the network) and any hub request raises."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import huggingface_hub
import pytest
import torch

import ompmoe
import ompmoe.engine.hub as hub
from ompmoe.data import resolve_shipped
from ompmoe.engine.export.checkpoint import MissingTokenizerWarning
from ompmoe.engine.export.config import load_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubAsked(BaseException):
    """Raised on any hub request: a BaseException, so that no library's ``except Exception`` falls back quietly."""


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path) -> Path:
    """A hub cache holding ``org/moe`` (the shipped model), offline mode off, the hub not answering, no back-off."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--moe" / "snapshots" / COMMIT
    shutil.copytree(resolve_shipped("shipped:tiny-moe"), snapshot)
    (cache / "models--org--moe" / "refs").mkdir()
    (cache / "models--org--moe" / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)

    def no_session():
        raise HubAsked("the hub was asked although it does not answer")

    monkeypatch.setattr(huggingface_hub, "get_session", no_session)
    monkeypatch.setattr(huggingface_hub.utils._http, "get_session", no_session)
    return snapshot


def test_a_cached_hub_model_and_its_tokenizer_load_from_the_cache_without_asking_the_hub(unreachable_hub):
    model = ompmoe.load_pruned("org/moe", dtype=torch.float32)
    expected = ompmoe.load_pruned(unreachable_hub, dtype=torch.float32)
    probe = torch.randint(0, model.config.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=probe).logits, expected(input_ids=probe).logits, rtol=0, atol=0)
    assert load_tokenizer("org/moe")("a b").input_ids == load_tokenizer(unreachable_hub)("a b").input_ids
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False  # offline only inside the reads


def test_saving_a_model_whose_uncached_source_the_hub_cannot_give_warns_at_once(unreachable_hub, tmp_path):
    """The tokenizer of ``org/absent`` is neither cached nor reachable: the save says so instead of sleeping through
    the retries (46 s for two saves of one test, before)."""
    model = ompmoe.load_pruned(unreachable_hub, dtype=torch.float32)
    model.config._name_or_path = "org/absent"
    with pytest.warns(MissingTokenizerWarning):
        ompmoe.save_pruned(model, tmp_path / "saved")
    assert not (tmp_path / "saved" / "tokenizer.json").exists()
    model.config._name_or_path = "org/moe"  # cached: its tokenizer is copied
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingTokenizerWarning)
        ompmoe.save_pruned(model, tmp_path / "with-tokenizer")
    assert (tmp_path / "with-tokenizer" / "tokenizer.json").read_bytes() == (unreachable_hub / "tokenizer.json").read_bytes()


def test_reads_stay_the_hub_libraries_own_where_the_hub_answers_or_the_name_is_a_folder(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    asked = []
    monkeypatch.setattr(hub, "hub_reachable", lambda: asked.append("probe") or True)
    with hub.cache_only_where_unreachable("org/moe"):
        assert constants.HF_HUB_OFFLINE is False
    monkeypatch.setattr(hub, "hub_reachable", lambda: asked.append("probe") or False)
    with hub.cache_only_where_unreachable(tmp_path):  # a local folder: no probe, nothing changed
        assert constants.HF_HUB_OFFLINE is False
    with hub.cache_only_where_unreachable("org/moe"):
        assert constants.HF_HUB_OFFLINE is True
    assert constants.HF_HUB_OFFLINE is False and asked == ["probe", "probe"]


def test_ompmoe_fit_prunes_a_cached_hub_model_without_asking_the_hub(unreachable_hub, tmp_path):
    """The whole command on a hub id: its early checks, the model, its config and its tokenizer all come from the
    cache; the pruned model carries the cached tokenizer."""
    from test_cli import tiny_config

    from ompmoe.cli import main

    config = tiny_config(tmp_path)
    main(["fit", "-c", str(config), "--model.model", "org/moe", "--trainer.enable_progress_bar=false"])
    assert ompmoe.MoEStats.load(tmp_path / "run" / "stats.safetensors").model_id == "org/moe"
    assert (tmp_path / "run" / "model" / "tokenizer.json").read_bytes() == (unreachable_hub / "tokenizer.json").read_bytes()


def test_a_path_that_does_not_exist_is_no_hub_id_and_is_refused_without_asking_the_hub(unreachable_hub, monkeypatch,
                                                                                          tmp_path):
    """It was taken for a hub id: a probe of the hub, then transformers' "Repo id must use alphanumeric chars"."""
    asked = []
    monkeypatch.setattr(hub, "hub_reachable", lambda: asked.append("probe") or False)
    for name in ("./not-written-yet", str(tmp_path / "absent")):
        with pytest.raises(FileNotFoundError) as refused:
            ompmoe.load_pruned(name)
        assert str(refused.value) == (f"{name.removeprefix('./')} does not exist (and is no hub id, org/name): pass a "
                                      "checkpoint directory or a hub id")
    assert asked == [] and hub.is_hub_id("org/moe") and not hub.is_hub_id(unreachable_hub)


def test_datasets_offline_mode_alone_leaves_model_reads_to_the_hub(monkeypatch):
    """HF_DATASETS_OFFLINE is about data sets: a model's reads stay the hub libraries' own where the hub answers."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    with hub.cache_only_where_unreachable("org/moe"):
        assert constants.HF_HUB_OFFLINE is False
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with hub.cache_only_where_unreachable("org/moe"):
        assert constants.HF_HUB_OFFLINE is True
