"""A mistyped or abbreviated option: one error line naming the option meant, status 2, no usage dump."""

from pathlib import Path

import pytest

from ompmoe.cli import main
from ompmoe.cli_options import unknown_options_line

CONFIG = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")


def error_lines(args, capsys) -> list[str]:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert "usage:" not in captured.out + captured.err
    return captured.err.strip().splitlines()


@pytest.mark.parametrize("typed, meant", [("--data.num_blokcs", "--data.num_blocks"),
                                          ("--data.num_block", "--data.num_blocks"),  # no abbreviations
                                          ("--ratoi", "--ratio"), ("--trainer.max_epoch", "--trainer.max_epochs")])
def test_fit_names_the_option_meant(typed, meant, capsys, tmp_path):
    lines = error_lines(["fit", "-c", CONFIG, typed, "8", "--trainer.callbacks.output_dir", str(tmp_path / "o")], capsys)
    assert lines == [f"error: unknown option {typed}: did you mean {meant}? (see ompmoe fit --help)"]
    assert not (tmp_path / "o").exists()


def test_prune_names_each_option_meant_and_refuses_abbreviations(capsys, tmp_path):
    assert error_lines(["prune", "--stats", "s", "--ratoi", "0.5", "--output_di", "o"], capsys) == [
        "error: unknown option --ratoi: did you mean --ratio?; --output_di: did you mean --output_dir? "
        "(see ompmoe prune --help)"]
    assert error_lines(["prune", "--stats", "s", "--rat", "0.5", "--output_dir", "o"], capsys) == [
        "error: unknown option --rat: did you mean --ratio? (see ompmoe prune --help)"]
    assert error_lines(["plot", "--stats", "s", "--output_dir", "o", "--qiet"], capsys) == [
        "error: unknown option --qiet: did you mean --quiet? (see ompmoe plot --help)"]


def test_an_option_with_nothing_close_says_so():
    assert unknown_options_line("unrecognized arguments: --zzz 3 --ratoi=2", ["--ratio", "--method"], "ompmoe x") == (
        "unknown option --zzz: no such option; --ratoi: did you mean --ratio? (see ompmoe x --help)")
    assert unknown_options_line("expected one argument", ["--ratio"], "ompmoe x") == \
        "expected one argument (see ompmoe x --help)"


def test_validate_names_the_option_meant(capsys, tmp_path):
    config = str(Path(__file__).parents[1] / "configs" / "eval" / "tiny.yaml")
    assert error_lines(["validate", "-c", config, "--data.limt", "3"], capsys) == [
        "error: unknown option --data.limt: did you mean --data.limit? (see ompmoe validate --help)"]


def test_the_fabric_script_names_the_option_meant():
    from ompmoe.lightning.fabric_prune import main as fabric_main

    with pytest.raises(ValueError) as error:
        fabric_main(["--data.num_blokcs", "3", "--ratio", "0.5"])
    assert str(error.value) == ("unknown option --data.num_blokcs: did you mean --data.num_blocks? "
                                "(see python -m ompmoe.lightning.fabric_prune --help)")
    with pytest.raises(ValueError) as error:  # an abbreviation is refused, not taken as --data.num_blocks
        fabric_main(["--data.num_block", "3"])
    assert "did you mean --data.num_blocks?" in str(error.value)


def test_report_names_the_option_meant(capsys, tmp_path):
    assert error_lines(["report", str(tmp_path / "a.json"), "--cost-tim", "cpu"], capsys) == [
        "error: unknown option --cost-tim: did you mean --cost-time? (see ompmoe report --help)"]
