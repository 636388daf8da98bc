"""Errors that used to come late or unreadable (issue 15): each reproduction asserts its exact message."""

from __future__ import annotations

import gzip
import tracemalloc

import numpy as np
import pytest
import torch

pytest.importorskip("lightning")

from ompmoe import MoEStats, PruningPlan, collect_stats, plan_pruning  # noqa: E402
from ompmoe.lightning.calibration_data import CalibrationDataModule  # noqa: E402
from ompmoe.cli import main, replan  # noqa: E402
from ompmoe.data import byte_tokens, shipped_model_path, shipped_text  # noqa: E402
from ompmoe.eval.report import report_table  # noqa: E402
from ompmoe.engine.tiny import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def stats_file(tmp_path_factory):
    model = tiny_model("qwen3_moe", seed=0)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 256, (2, 24), generator=generator) for _ in range(2)]
    path = tmp_path_factory.mktemp("stats") / "stats.safetensors"
    collect_stats(model, batches, model_id="tiny-qwen3_moe").save(path)
    return str(path)


def cli_error(args: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(args)
    return str(info.value)


# ------------------------------------------------------------------------------- prune --ratio
RATIO_HINT = "ratio must be a number between 0 and 1 or a list of them, e.g. --ratio 0.5 or --ratio [0.25,0.5]; got "


@pytest.mark.parametrize(
    ("ratio", "message"),
    [
        ("[]", "error: give at least one ratio, e.g. --ratio [0.5]"),
        ("[0.5,0.5]", "error: ratio 0.5 is given more than once ([0.5, 0.5]); each ratio writes "
                      "plan-<ratio>.json, so give each once, e.g. --ratio [0.5]"),
        ("abc", "error: " + RATIO_HINT + "abc"),
        ("[true]", "error: " + RATIO_HINT + "[True]"),
    ],
)
def test_prune_refuses_bad_ratios_before_any_work(tmp_path, ratio, message):
    # The statistics file does not exist: the ratio is refused before it is even looked for.
    out = tmp_path / "plans"
    assert cli_error(["prune", "--stats", str(tmp_path / "none"), "--ratio", ratio, "--output_dir", str(out)]) == message
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ratios", [["--ratio", "0.25", "--ratio", "0.5"], ["--ratio=0.25", "--ratio", "[0.5]"]])
def test_prune_refuses_a_repeated_ratio_before_any_work(tmp_path, ratios):
    """The parser keeps the last of a repeated flag: two --ratio would silently plan only the last ratio."""
    out = tmp_path / "plans"
    shown = "0.25, 0.5" if ratios[0] == "--ratio" else "0.25, [0.5]"
    assert cli_error(["prune", "--stats", str(tmp_path / "none"), *ratios, "--output_dir", str(out)]) == (
        f"error: --ratio is given 2 times ({shown}); the parser keeps only the last. Give them in one list: "
        "--ratio [0.25,0.5]")
    assert not out.exists()


def test_other_argument_errors_are_one_line(tmp_path):
    assert cli_error(["prune", "--stats", "x"]) == (
        "error: the following arguments are required: ratio, output_dir (see ompmoe prune --help)"
    )


@pytest.mark.parametrize("ratio", [0.5, np.float32(0.5), torch.tensor(0.5), [np.float64(0.5)], torch.tensor([0.5])])
def test_replan_accepts_any_real_number_as_a_float(tmp_path, stats_file, ratio):
    written = replan(stats=stats_file, ratio=ratio, output_dir=str(tmp_path / "p"))
    assert written == [tmp_path / "p" / "plan-0.5.json"]
    assert PruningPlan.load(written[0]) == plan_pruning(MoEStats.load(stats_file), 0.5)


@pytest.mark.parametrize(("ratio", "shown"), [("0.5", "'0.5' (str)"), (["0.5"], "'0.5' (str)"), (True, "True (bool)"),
                                              ([float("nan")], "nan (float)")])
def test_replan_refuses_strings_and_booleans(tmp_path, ratio, shown):
    with pytest.raises(ValueError) as info:
        replan(stats=str(tmp_path / "none"), ratio=ratio, output_dir=str(tmp_path / "p"))
    assert str(info.value) == f"ratio must be numbers between 0 and 1, e.g. --ratio [0.5]; got {shown}"


def test_main_does_not_hide_attribute_errors(monkeypatch):
    import ompmoe.cli

    def buggy(**_):
        raise AttributeError("'NoneType' object has no attribute 'layers'")

    monkeypatch.setitem(ompmoe.cli.COMMANDS, "prune", buggy)
    monkeypatch.setattr("jsonargparse.auto_cli", lambda function, **_: function())
    with pytest.raises(AttributeError, match="no attribute 'layers'"):
        main(["prune"])


# ------------------------------------------------------------------------- calibration files
def test_binary_txt_names_file_offset_and_line(tmp_path):
    file = tmp_path / "data.txt"
    file.write_bytes(b"hello world\nline two \xff\xfe bad\n")
    dm = CalibrationDataModule(str(file), tokenizer="bytes", seq_len=4, num_blocks=2)
    with pytest.raises(ValueError) as info:
        dm.setup()
    assert str(info.value) == (
        f"Calibration file {file} is not UTF-8 text: invalid start byte (byte b'\\xff') at byte offset 21 (line 2). "
        "Give a UTF-8 .txt file (e.g. convert it with `iconv -f <encoding> -t UTF-8`), or a .jsonl/.parquet file "
        "for other data."
    )


def test_invalid_utf8_past_the_first_chunk_is_located_exactly(tmp_path):
    file = tmp_path / "data.txt"
    head = ("word " * 20_000 + "\n") * 2  # 200 002 bytes, 2 lines, then a split 3-byte sequence
    file.write_bytes(head.encode() + "é".encode() + b"\xe2\x82" + b"x")
    dm = CalibrationDataModule(str(file), tokenizer="bytes", seq_len=1000, num_blocks=500)
    with pytest.raises(ValueError, match=r"invalid continuation byte \(byte b'\\xe2\\x82'\) at byte offset 200004 \(line 3\)"):
        dm.setup()


def test_malformed_jsonl_names_file_line_and_json_error(tmp_path):
    file = tmp_path / "data.jsonl"
    file.write_text('{"text": "a"}\n{"text": "b"\n{"text": "c"}\n')
    dm = CalibrationDataModule(str(file), tokenizer="bytes", seq_len=1, num_blocks=1)
    with pytest.raises(ValueError) as info:
        dm.setup()
    assert str(info.value) == (
        f"Calibration file {file} line 2 is not a JSON record: Expecting ',' delimiter (column 13). Fix or remove "
        'that line: each line must be one JSON object with the text in a field, e.g. {"text": "..."}.'
    )


def test_malformed_second_jsonl_gz_file_is_the_one_named(tmp_path):
    good, bad = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    good.write_bytes(gzip.compress(b'{"text": "fine"}\n'))
    bad.write_bytes(gzip.compress(b'{"text": "fine"}\n\nnot json\n'))
    dm = CalibrationDataModule(str(good), data_files=[str(bad)], tokenizer="bytes", seq_len=1, num_blocks=1)
    with pytest.raises(ValueError, match=rf"^Calibration file {bad} line 3 is not a JSON record: Expecting value \(column 1\)"):
        dm.setup()


def test_malformed_parquet_names_the_file(tmp_path):
    file = tmp_path / "data.parquet"
    file.write_bytes(b"this is not parquet at all")
    dm = CalibrationDataModule(str(file), tokenizer="bytes", seq_len=1, num_blocks=1)
    with pytest.raises(ValueError, match=rf"^Cannot read calibration file\(s\) {file} as parquet: "):
        dm.setup()


def test_empty_calibration_hint_suggests_no_zero():
    from ompmoe.data import token_blocks

    with pytest.raises(ValueError) as info:
        token_blocks(torch.tensor([], dtype=torch.long), 4, 2)
    assert str(info.value) == "Calibration text has 0 tokens but 2 blocks of 4 need 8: add text (8 more tokens)."
    with pytest.raises(ValueError) as info:
        token_blocks(torch.arange(5), 4, 2)
    assert str(info.value) == "Calibration text has 5 tokens but 2 blocks of 4 need 8: add text, or lower num_blocks to 1 or seq_len to 2."


# ------------------------------------------------------------------- incremental .txt reading
@pytest.mark.parametrize("tokenizer", ["bytes", "shipped:tiny-moe"])
def test_txt_in_pieces_equals_whole_file_tokenization(tmp_path, tokenizer, monkeypatch):
    import ompmoe.data.sources as cd

    monkeypatch.setattr(cd, "_TEXT_CHUNK", 4096)  # many piece boundaries inside the shipped text
    file = tmp_path / "shipped.txt"
    text = shipped_text()
    file.write_text(text, encoding="utf-8")
    if tokenizer == "bytes":
        whole = byte_tokens(text)
    else:
        from transformers import AutoTokenizer

        whole = torch.tensor(AutoTokenizer.from_pretrained(str(shipped_model_path()))(text, add_special_tokens=False)["input_ids"])
    seq_len = 256
    num_blocks = whole.numel() // seq_len
    dm = CalibrationDataModule(str(file), tokenizer=tokenizer, seq_len=seq_len, num_blocks=num_blocks)
    assert torch.equal(dm.blocks.reshape(-1), whole[: seq_len * num_blocks])
    assert list(dm.documents()) == [text]


def test_large_one_line_txt_is_not_read_whole(tmp_path):
    file = tmp_path / "big.txt"
    file.write_text("calibration words " * 460_000, encoding="utf-8")  # 8.3 MB, one line
    assert file.stat().st_size > 8_000_000
    dm = CalibrationDataModule(str(file), tokenizer="bytes", seq_len=512, num_blocks=8)
    tracemalloc.start()
    blocks = dm.blocks
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert bytes(blocks.reshape(-1).tolist()).decode() == ("calibration words " * 460_000)[: 512 * 8]
    assert peak < 3_000_000  # reading the file whole alone would take 8.3 MB


# ------------------------------------------------------------------------------- report cells
def test_report_escapes_hostile_labels_and_names():
    def result(label: str) -> dict:
        return {"ompmoe": {"label": label, "model": {}, "columns": [{"name": "arc|easy\nacc"}], "scores": {"arc|easy\nacc": 0.5}}}

    table = report_table([result("base"), result("evil | 1 | 2 |\n| forged | row |")])
    rows = table.split("\n\n")[0].splitlines()
    assert len(rows) == 4  # header, rule, two results
    assert rows[0] == "| Model | arc\\|easy acc | Average | Retained (%) |"
    assert rows[3] == "| evil \\| 1 \\| 2 \\| \\| forged \\| row \\| | 50.00 | 50.00 | 100.0 |"
    assert {row.replace("\\|", "").count("|") for row in rows} == {5}


def test_ctrl_c_ends_a_command_with_one_line_and_status_130(monkeypatch, capsys):
    import ompmoe.cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(ompmoe.cli, "command_cli", interrupted)
    with pytest.raises(SystemExit) as info:
        main(["plot", "--stats", "s", "--output_dir", "o"])
    assert info.value.code == 130 and capsys.readouterr().err == (
        "ompmoe: interrupted; nothing was written (o is as it was): run the same command again to redo it\n")


def test_a_bare_overwrite_is_true_on_the_demo_and_the_fabric_script(monkeypatch, tmp_path, capsys):
    import sys

    import ompmoe.recipes.quickstart as quickstart
    from ompmoe.lightning import fabric_prune

    given = []

    def prune_tiny_model(output_dir: str = "outputs/demo", overwrite: bool = False) -> None:
        given.append((output_dir, overwrite))

    monkeypatch.setattr(quickstart, "prune_tiny_model", prune_tiny_model)
    monkeypatch.setattr(sys, "argv", ["ompmoe-demo", "--overwrite", "--output_dir", str(tmp_path)])
    quickstart.main()
    assert given == [(str(tmp_path), True)]
    assert fabric_prune.main(["--overwrite", "--path"]) is None  # --path: print the path once parsed, and stop
    assert capsys.readouterr().out.strip().endswith("fabric_prune.py")


def test_the_finetuning_cli_ends_bad_input_in_one_line_with_status_2(tmp_path, capsys):
    from ompmoe.lightning.finetune_module import main as finetune_main

    with pytest.raises(SystemExit) as info:
        finetune_main(["fit", "--model.model", str(tmp_path / "no-model"), "--model.save_dir", str(tmp_path / "out"),
                       "--trainer.accelerator", "cpu"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: model path {str(tmp_path / 'no-model')!r} does not exist; {str(tmp_path)!r} exists")
    assert not (tmp_path / "out").exists()
