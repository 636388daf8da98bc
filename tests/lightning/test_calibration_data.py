"""CalibrationDataModule: raw text -> one token stream -> the paper's fixed-length blocks. Offline only."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("lightning")
datasets = pytest.importorskip("datasets")

import ompmoe  # noqa: E402
from ompmoe.data.sources import HubUnavailableError, evol_code_text, tulu_text, wikitext_articles  # noqa: E402
from ompmoe.lightning.calibration_data import CalibrationDataModule  # noqa: E402
from ompmoe.data import byte_tokens, shipped_text  # noqa: E402
from offline_guards import guard_offline  # noqa: E402

DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Mixture-of-experts layers route every token to a few experts.\nThe router picks them.",
    "   ",  # whitespace-only: skipped
    "Orthogonal matching pursuit greedily picks the atom that best explains the residual. " * 3,
    "",
    "A last short document about pruning experts without training.",
]
KEPT = [doc for doc in DOCS if doc.strip()]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A real Hugging Face tokenizer (byte-level BPE with an eos token), trained here, saved to disk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(KEPT * 4, trainer=trainer)
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    loaded = AutoTokenizer.from_pretrained(str(path))
    assert loaded.eos_token_id is not None
    return str(path), loaded


def literal_stream(tokenizer, docs: list[str]) -> list[int]:
    """Per-document token ids (no special tokens), eos between consecutive documents."""
    ids: list[int] = []
    for index, doc in enumerate(docs):
        if index:
            ids.append(tokenizer.eos_token_id)
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
    return ids


def expected_blocks(ids: list[int], seq_len: int, num_blocks: int) -> torch.Tensor:
    assert len(ids) >= seq_len * num_blocks
    return torch.tensor(ids[: seq_len * num_blocks]).view(num_blocks, seq_len)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def max_blocks(ids: list[int], seq_len: int) -> int:
    return len(ids) // seq_len


# ------------------------------------------------------------------------------------ shipped


def test_shipped_bytes_blocks_and_batches():
    dm = CalibrationDataModule("shipped", tokenizer="bytes", seq_len=256, num_blocks=5, batch_size=2)
    expected = byte_tokens(shipped_text())[: 256 * 5].view(5, 256)
    torch.testing.assert_close(dm.blocks, expected)
    assert dm.blocks.dtype == torch.long and dm.num_tokens == 1280
    assert dm.describe() == "shipped:ompmoe/data/calibration.txt"
    assert len(dm.dataset) == 5

    batches = list(dm.train_dataloader())
    assert [tuple(b["input_ids"].shape) for b in batches] == [(2, 256), (2, 256), (1, 256)]
    torch.testing.assert_close(torch.cat([b["input_ids"] for b in batches]), expected)  # block order
    for batch in batches:
        assert set(batch) == {"input_ids", "attention_mask"}
        assert batch["attention_mask"].dtype == torch.long and bool((batch["attention_mask"] == 1).all())
    assert [b["input_ids"].shape for b in dm.predict_dataloader()] == [b["input_ids"].shape for b in batches]


def test_lazy_attribute_on_package():
    assert ompmoe.CalibrationDataModule is CalibrationDataModule
    assert "CalibrationDataModule" in dir(ompmoe)
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        ompmoe.NotAThing  # noqa: B018


def test_core_package_imports_without_lightning(monkeypatch):
    """A fresh ``import ompmoe`` with lightning unavailable works; only the lazy attribute needs it."""
    for name in [name for name in sys.modules if name == "ompmoe" or name.startswith("ompmoe.")]:
        monkeypatch.delitem(sys.modules, name)  # restored after the test
    for name in [name for name in sys.modules if name == "lightning" or name.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "lightning", None)
    import ompmoe as fresh

    assert fresh is not ompmoe
    assert "ompmoe.lightning.calibration_data" not in sys.modules
    with pytest.raises(ImportError):
        fresh.CalibrationDataModule  # noqa: B018


# ------------------------------------------------------------------------------- local files


def test_txt_files_with_hf_tokenizer(tmp_path, hf_tokenizer):
    path, tok = hf_tokenizer
    files = []
    for index, doc in enumerate(KEPT):
        files.append(tmp_path / f"doc{index}.txt")
        files[-1].write_text(doc, encoding="utf-8")
    ids = literal_stream(tok, KEPT)
    seq_len = 16
    num_blocks = max_blocks(ids, seq_len)  # uses (almost) every document: separators all matter
    dm = CalibrationDataModule(
        str(files[0]), tokenizer=path, seq_len=seq_len, num_blocks=num_blocks, data_files=[str(f) for f in files[1:]]
    )
    dm.setup("fit")
    torch.testing.assert_close(dm.blocks, expected_blocks(ids, seq_len, num_blocks))
    assert int((dm.blocks == tok.eos_token_id).sum()) == len(KEPT) - 1
    assert dm.describe() == "file:" + ",".join(str(f.resolve()) for f in files)


def test_txt_file_is_one_document(tmp_path, hf_tokenizer):
    path, tok = hf_tokenizer
    text = "\n\n".join(KEPT)
    file = tmp_path / "corpus.txt"
    file.write_text(text, encoding="utf-8")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    dm = CalibrationDataModule(str(file), tokenizer=path, seq_len=8, num_blocks=max_blocks(ids, 8))
    torch.testing.assert_close(dm.blocks, expected_blocks(ids, 8, max_blocks(ids, 8)))
    assert tok.eos_token_id not in dm.blocks.tolist()


def test_jsonl_text_field_skips_blank_documents(tmp_path, hf_tokenizer):
    path, tok = hf_tokenizer
    file = write_jsonl(tmp_path / "data.jsonl", [{"body": doc, "id": i} for i, doc in enumerate(DOCS)])
    ids = literal_stream(tok, KEPT)
    dm = CalibrationDataModule(str(file), tokenizer=path, seq_len=10, num_blocks=max_blocks(ids, 10), text_field="body")
    torch.testing.assert_close(dm.blocks, expected_blocks(ids, 10, max_blocks(ids, 10)))


def test_jsonl_stops_reading_once_enough_tokens(tmp_path, monkeypatch):
    # 20 000 documents; 2 blocks of 16 bytes need only the first few.
    from ompmoe.data.sources import TextSource

    file = write_jsonl(tmp_path / "big.jsonl", [{"text": f"document number {i}. "} for i in range(20_000)])
    seen = []
    items = TextSource.items

    def counting(self, domain=None):
        for item in items(self, domain):
            seen.append(item)
            yield item

    monkeypatch.setattr(TextSource, "items", counting)
    dm = CalibrationDataModule(str(file), tokenizer="bytes", seq_len=16, num_blocks=2)
    assert bytes(dm.blocks.reshape(-1).tolist()).decode() == "document number 0. document number 1. docum"[:32]
    assert 0 < len(seen) <= 64  # one tokenizer batch at most, never the whole corpus


def test_parquet_with_seed_matches_datasets_shuffle(tmp_path, hf_tokenizer):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path, tok = hf_tokenizer
    file = tmp_path / "data.parquet"
    pd.DataFrame({"text": KEPT * 3}).to_parquet(file)
    order = datasets.Dataset.from_dict({"text": KEPT * 3}).shuffle(seed=7)["text"]
    assert order != KEPT * 3
    ids = literal_stream(tok, list(order))
    dm = CalibrationDataModule(str(file), tokenizer=path, seq_len=32, num_blocks=max_blocks(ids, 32), seed=7)
    torch.testing.assert_close(dm.blocks, expected_blocks(ids, 32, max_blocks(ids, 32)))
    assert dm.describe() == f"file:{file.resolve()}:seed7"


def test_preset_format_on_local_copy(tmp_path, hf_tokenizer):
    """evol-code with data_files: the preset's instruction + output format and seed-42 shuffle, offline."""
    path, tok = hf_tokenizer
    records = [{"instruction": f"Write function {i}.", "output": f"def f{i}():\n    return {i}"} for i in range(12)]
    file = write_jsonl(tmp_path / "evol.jsonl", records)
    shuffled = datasets.Dataset.from_list(records).shuffle(seed=42)
    docs = [f"{row['instruction']}\n\n{row['output']}" for row in shuffled]
    ids = literal_stream(tok, docs)
    dm = CalibrationDataModule(
        "evol-code", tokenizer=path, seq_len=12, num_blocks=max_blocks(ids, 12), data_files=str(file)
    )
    torch.testing.assert_close(dm.blocks, expected_blocks(ids, 12, max_blocks(ids, 12)))
    assert dm.describe() == f"evol-code:file:{file.resolve()}:seed42"


def test_hf_tokenizer_without_eos_has_no_separator(tmp_path, hf_tokenizer):
    from transformers import AutoTokenizer

    path, _ = hf_tokenizer
    tok = AutoTokenizer.from_pretrained(path)
    tok.eos_token = None
    no_eos = tmp_path / "no_eos"
    tok.save_pretrained(no_eos)
    assert AutoTokenizer.from_pretrained(str(no_eos)).eos_token_id is None
    file = write_jsonl(tmp_path / "d.jsonl", [{"text": doc} for doc in KEPT])
    ids = [i for doc in KEPT for i in tok(doc, add_special_tokens=False)["input_ids"]]
    dm = CalibrationDataModule(str(file), tokenizer=str(no_eos), seq_len=8, num_blocks=max_blocks(ids, 8))
    torch.testing.assert_close(dm.blocks, expected_blocks(ids, 8, max_blocks(ids, 8)))


# ---------------------------------------------------------------------------- text formats


def test_preset_text_formats():
    row = {"id": "x", "prompt": "What is 2+2?", "messages": [
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}
    assert tulu_text(row) == "What is 2+2?\n\n4"
    assert tulu_text({"prompt": "P", "messages": [{"role": "assistant", "content": "A"}]}) == "P\n\nA"
    assert "user" not in tulu_text(row) and "<|" not in tulu_text(row)  # no roles, no chat template
    assert evol_code_text({"instruction": "Sort a list.", "output": "sorted(x)"}) == "Sort a list.\n\nsorted(x)"
    lines = ["", " = Alpha = \n", "", " Alpha text .\n", " = = Section = = \n", " more .\n", "",
             " = Beta = \n", " Beta text .\n"]
    assert list(wikitext_articles(lines)) == [
        " = Alpha = \n\n Alpha text .\n = = Section = = \n more .\n\n",  # leading blank row dropped
        " = Beta = \n Beta text .\n",
    ]


# -------------------------------------------------------------------------------------- errors


def test_too_little_text_error(tmp_path):
    file = tmp_path / "short.txt"
    file.write_text("abc", encoding="utf-8")
    dm = CalibrationDataModule(str(file), tokenizer="bytes", seq_len=4, num_blocks=2)
    message = (
        "Calibration text has 3 tokens but 2 blocks of 4 need 8: "
        "add text, or lower seq_len to 1."
    )
    with pytest.raises(ValueError) as info:
        dm.setup("fit")
    assert str(info.value) == message
    with pytest.raises(ValueError, match="has 3 tokens"):
        dm.blocks  # noqa: B018


def test_shipped_too_short_for_paper_defaults():
    dm = CalibrationDataModule("shipped", tokenizer="bytes")
    found = len(shipped_text().encode("utf-8"))
    with pytest.raises(ValueError, match=f"has {found} tokens but 64 blocks of 4096 need 262144"):
        dm.setup()


@pytest.fixture
def offline_empty_cache(monkeypatch, tmp_path):
    """Offline mode set after import, and an empty datasets/hub cache."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("wikitext2", "wikitext"),
        ("tulu-math", "allenai/tulu-3-sft-personas-math"),
        ("someone/some-corpus", "someone/some-corpus"),
    ],
)
def test_hub_source_offline_fails_fast_and_clearly(offline_empty_cache, monkeypatch, source, name):
    """Fast without a clock: one read of the local cache with the hub libraries forced offline, no connection
    attempted, no retry back-off slept, and the hub is not even probed (offline mode says enough)."""
    from huggingface_hub import constants

    import ompmoe.data.sources as module

    dm = CalibrationDataModule(source, tokenizer="bytes", seq_len=8, num_blocks=1)
    probes = []
    monkeypatch.setattr(module, "hub_reachable", lambda: probes.append("probe") or True)
    guard = guard_offline(monkeypatch)
    with pytest.raises(HubUnavailableError) as info:
        dm.prepare_data()
    guard.assert_one_cache_only_read(name)  # the path given to load_dataset, which the message names
    assert probes == []
    message = str(info.value)
    assert repr(name) in message and "offline mode" in message
    assert "local files" in message and ".jsonl" in message and "source='shipped'" in message
    # the hub libraries' offline flags are restored
    assert (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE) == offline_empty_cache
    with pytest.raises(HubUnavailableError):
        dm.setup()


def test_hub_unreachable_fails_fast(monkeypatch, tmp_path):
    import ompmoe.data.sources as module

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(module, "offline_mode", lambda: False)
    monkeypatch.setattr(module, "hub_reachable", lambda: False)  # never touch the network in tests
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    guard = guard_offline(monkeypatch)
    with pytest.raises(HubUnavailableError, match="'allenai/c4'.*unreachable"):
        CalibrationDataModule("c4", tokenizer="bytes").prepare_data()
    # Fast without a clock: the unreachable hub turns the read into one cache-only read, no connection, no back-off.
    guard.assert_one_cache_only_read("allenai/c4")


def test_a_hub_model_checked_twice_probes_the_hub_once(monkeypatch):
    """CalibrationModule checks the name when built and load_model again: one HEAD request while the hub's last
    answer (or its silence) is recent, a new one once that is old."""
    import huggingface_hub

    import ompmoe.engine.hub as hub
    from ompmoe.lightning.models import resolve_model

    heads = []

    class Session:
        reachable = False

        def head(self, url, timeout):
            heads.append((url, timeout))
            if not self.reachable:
                raise ConnectionError("refused")

    session = Session()
    monkeypatch.setattr(hub, "_ANSWERED", {})
    monkeypatch.setattr("ompmoe.data.sources.offline_mode", lambda: False)
    monkeypatch.setattr(huggingface_hub, "get_session", lambda: session)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo_id, filename: None)

    def age() -> None:  # the last probe is now as old as a kept outcome may be
        answered, when = hub._ANSWERED[heads[-1][0]]
        hub._ANSWERED[heads[-1][0]] = (answered, when - hub.ANSWER_KEPT_S)

    for _ in range(2):
        with pytest.raises(HubUnavailableError, match="'someone/moe'.*unreachable"):
            resolve_model("someone/moe")
    assert len(heads) == 1 and heads[-1][1] == hub.PROBE_TIMEOUT_S  # the silence is kept too
    session.reachable = True
    with pytest.raises(HubUnavailableError, match="'someone/moe'.*unreachable"):
        resolve_model("someone/moe")  # still within the kept silence
    age()
    assert [resolve_model("someone/moe") for _ in range(2)] == ["someone/moe", "someone/moe"]
    assert len(heads) == 2
    age()
    session.reachable = False
    with pytest.raises(HubUnavailableError, match="'someone/moe'.*unreachable"):
        resolve_model("someone/moe")
    assert len(heads) == 3


def test_source_errors(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown calibration source 'wikitext'.*wikitext2.*owner/name"):
        CalibrationDataModule("wikitext")
    bad = tmp_path / "notes.docx"
    bad.write_text("x")
    with pytest.raises(ValueError, match=r"Unsupported calibration file .*notes\.docx.*\.txt"):
        CalibrationDataModule(str(bad))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        CalibrationDataModule(str(tmp_path / "missing.jsonl"))
    txt, jsonl = tmp_path / "a.txt", write_jsonl(tmp_path / "b.jsonl", [{"text": "x"}])
    txt.write_text("x")
    with pytest.raises(ValueError, match="share one format"):
        CalibrationDataModule(str(txt), data_files=str(jsonl))
    with pytest.raises(ValueError, match="must be positive"):
        CalibrationDataModule("shipped", seq_len=0)


def test_missing_text_field(tmp_path):
    file = write_jsonl(tmp_path / "d.jsonl", [{"content": "hello"}])
    dm = CalibrationDataModule(str(file), tokenizer="bytes", seq_len=2, num_blocks=1)
    with pytest.raises(ValueError, match=r"no text field 'text'.*\['content'\]"):
        dm.setup()


def test_tokenizer_required():
    dm = CalibrationDataModule("shipped", seq_len=8, num_blocks=1)
    with pytest.raises(ValueError, match="needs a tokenizer.*model_name_or_path"):
        dm.setup()


# ------------------------------------------------------------------------ lightning / CLI


@pytest.mark.filterwarnings("ignore:.*configure_optimizers", "ignore:.*LeafSpec")
def test_trainer_supplies_tokenizer(tmp_path, hf_tokenizer):
    import lightning.pytorch as pl

    path, tok = hf_tokenizer

    class Recorder(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model_name_or_path = "not-a-tokenizer"  # tokenizer_name wins
            self.tokenizer_name = path
            self.automatic_optimization = False
            self.seen: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["input_ids"])

        def predict_step(self, batch, batch_idx):
            return batch["input_ids"]

        def configure_optimizers(self):
            return None

    file = write_jsonl(tmp_path / "d.jsonl", [{"text": doc} for doc in KEPT])
    ids = literal_stream(tok, KEPT)
    num_blocks = max_blocks(ids, 8)
    dm = CalibrationDataModule(str(file), seq_len=8, num_blocks=num_blocks, batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    module = Recorder()
    trainer.fit(module, datamodule=dm)
    expected = expected_blocks(ids, 8, num_blocks)
    torch.testing.assert_close(torch.cat(module.seen), expected)
    predicted = trainer.predict(module, datamodule=dm)
    torch.testing.assert_close(torch.cat(predicted), expected)


def test_cli_arguments_and_help():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(CalibrationDataModule, "data")
    cfg = parser.parse_args(["--data.source=shipped", "--data.tokenizer=bytes", "--data.data_files=[a.txt,b.txt]"])
    assert cfg.data.source == "shipped" and cfg.data.data_files == ["a.txt", "b.txt"] and cfg.data.seq_len == 4096
    help_text = parser.format_help()
    assert "tulu-math" in help_text and "Tokens per calibration block" in help_text
