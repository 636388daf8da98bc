"""``ompmoe report``: exact tables and messages from small hand-written results files.

The files carry only what the report reads (the ``ompmoe`` summary, the identity fields and lm-eval's
``n-samples``), so every expected table below can be checked by hand.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

import ompmoe

from ompmoe.cli import main
from ompmoe.eval.report import ResultsFileError, report_table

RULE = "|---|---:|---:|---:|---:|"


def results(label: str | None, scores: dict, *, items: int = 1000, pruning: dict | None = None,
            chance: dict | None = None, lower: tuple = (), cost: dict | None = None, model: dict | None = None) -> dict:
    """A results file as LMEvalDataModule writes it, reduced to what the report reads."""
    columns = [{"name": name, "source": name, "metric": "acc,none", "primary": True,
                "higher_is_better": name not in lower, **({"chance": chance[name]} if chance and name in chance else {})}
               for name in scores]
    info = {"model": "org/base", "base_model": "org/base", "weights_fingerprint": "0" * 16, **(model or {})}
    if pruning:
        info["pruning"] = pruning
    summary = {"label": label, "model": info, "columns": columns, "scores": dict(scores)}
    if cost:
        summary["cost"] = cost
    return {
        "ompmoe": summary,
        "config": {"tokenizer": "tok", "tokenizer_fingerprint": "1" * 16},
        "versions": {name: 1.0 for name in scores},
        "n-samples": {name: {"original": items, "effective": items} for name in scores},
    }


PRUNED = {"experts": 64, "kept_experts": 32, "removed_fraction": 0.5, "kept_per_layer": [8, 8, 8, 8]}


def write(path: Path, data: dict) -> str:
    path.write_text(json.dumps(data))
    return str(path)


# ------------------------------------------------------------------------------- output file
def test_output_never_replaces_one_of_the_results_files(tmp_path, capsys):
    a = write(tmp_path / "a.json", results("original", {"arc": 0.8}))
    b = write(tmp_path / "b.json", results("pruned", {"arc": 0.6}, pruning=PRUNED))
    before = Path(a).read_text()
    for extra in ([], ["--overwrite"], ["--overwrite", "true"]):
        with pytest.raises(SystemExit) as error:
            main(["report", a, b, "--output", a, *extra])
        assert str(error.value) == (
            f"error: --output {a} is one of the results files being reported; writing the table there would "
            "destroy those results. Choose another output path, e.g. table.md.")
        assert Path(a).read_text() == before
    assert capsys.readouterr().out == ""


def test_existing_output_is_refused_without_overwrite(tmp_path, capsys):
    a = write(tmp_path / "a.json", results("original", {"arc": 0.8}))
    table = tmp_path / "table.md"
    table.write_text("my notes")
    with pytest.raises(SystemExit) as error:
        main(["report", a, "--output", str(table)])
    # ompmoe.engine.io's message: the path, then how to replace it.
    assert str(error.value).startswith(f"error: {table} already exists; ") and "--overwrite" in str(error.value)
    assert table.read_text() == "my notes" and capsys.readouterr().out == ""
    main(["report", a, "--output", str(table), "--overwrite", "true"])
    assert table.read_text() == capsys.readouterr().out != "my notes"
    main(["report", a, "--output", str(table), "--overwrite"])
    assert table.read_text() == capsys.readouterr().out


# ------------------------------------------------------------------------------- averages
@pytest.mark.parametrize("missing", ["absent", math.nan, math.inf, None, "N/A"])
def test_average_covers_only_tasks_every_row_scored(missing):
    original = results("original", {"arc": 0.8, "mmlu": 0.2})
    pruned = results("pruned", {"arc": 0.8, "mmlu": 0.2}, pruning=PRUNED)
    if missing == "absent":
        del pruned["ompmoe"]["scores"]["mmlu"]
    else:
        pruned["ompmoe"]["scores"]["mmlu"] = missing
    table = report_table([original, pruned])
    assert table == (
        "| Model | arc | mmlu ‡ | Average | Retained (%) |\n"
        "|---|---:|---:|---:|---:|\n"
        "| original | 80.00 | 20.00 | 80.00 | 100.0 |\n"
        "| pruned | 80.00 | – | 80.00 | 100.0 |\n"
        "\n"
        "Scores in %. Average over arc. Retained: Average as a percentage of original's. "
        "‡ mmlu is left out of Average and Retained: no finite score for pruned.\n"
    )


def test_tasks_where_every_model_scores_zero_or_at_chance_are_left_out():
    chance = {"arc": 0.25, "boolq": 0.5}
    original = results("original", {"arc": 0.2505, "boolq": 0.7, "gsm8k": 0.0}, chance=chance)
    pruned = results("pruned", {"arc": 0.24, "boolq": 0.35, "gsm8k": 0.0}, chance=chance, pruning=PRUNED)
    table = report_table([original, pruned])
    assert table == (
        "| Model | arc ‡ | boolq | gsm8k ‡ | Average | Retained (%) |\n"
        "|---|---:|---:|---:|---:|---:|\n"
        "| original | 25.05 | 70.00 | 0.00 | 70.00 | 100.0 |\n"
        "| pruned | 24.00 | 35.00 | 0.00 | 35.00 | 50.0 |\n"
        "\n"
        "Scores in %. Average over boolq. Retained: Average as a percentage of original's. "
        "‡ arc is left out of Average and Retained: no model scores above chance (25.0%, or within one item "
        "(0.1 points) of it). ‡ gsm8k is left out of Average and Retained: every model scores 0.\n"
    )
    # One model above chance by more than one item: the task counts.
    original["ompmoe"]["scores"]["arc"] = 0.3
    assert "Average over arc, boolq." in report_table([original, pruned])


def test_no_task_left_to_average_says_so():
    table = report_table([results("original", {"gen": 0.0}), results("pruned", {"gen": 0.0}, pruning=PRUNED)])
    assert table.splitlines()[2:4] == ["| original | 0.00 | – | – |", "| pruned | 0.00 | – | – |"]
    assert "No column is averaged." in table


# ------------------------------------------------------------------------------- noise notes
def test_noise_notes_speak_in_the_metrics_own_terms():
    original = results("original", {"mc": 0.5, "ppl": 21.5}, items=7, lower=("ppl",))
    pruned = results("pruned", {"mc": 0.75, "ppl": 30.25}, items=7, lower=("ppl",), pruning=PRUNED)
    table = report_table([original, pruned])
    assert table == (
        "| Model | mc † | ppl | Average | Retained (%) |\n"
        "|---|---:|---:|---:|---:|\n"
        "| original | 50.00 | 21.50 | 50.00 | 100.0 |\n"
        "| pruned | 75.00 | 30.25 | 75.00 | 150.0 |\n"
        "\n"
        "Scores in %, except ppl (lower is better). Average over mc. Retained: Average as a percentage of "
        "original's. † mc: 7 items (< 100); a difference of 14.3 points is one item, treat it as noise.\n"
    )


# ------------------------------------------------------------------------------- cost
def test_cost_and_speedup_relative_to_the_original():
    settings = {"device": "cpu", "threads": 1, "ranks": 1}
    kept = {"dtype": "float32", "experts_implementation": "grouped_mm"}
    rows = [
        results("original", {"arc": 0.6}, cost={"seconds": 2459.0, **settings}, model=kept),
        results("static", {"arc": 0.489}, cost={"seconds": 1825.0, **settings}, model=kept, pruning=PRUNED),
        results("adaptive", {"arc": 0.476}, cost={"seconds": 1690.0, **settings}, model=kept, pruning=PRUNED),
        results("no cost", {"arc": 0.5}, model=kept, pruning=PRUNED),
    ]
    table = report_table(rows)
    assert table == (
        "| Model | arc | Average | Retained (%) | Cost (s) | Speedup |\n"
        "|---|---:|---:|---:|---:|---:|\n"
        "| original | 60.00 | 60.00 | 100.0 | 2459 | 1.00× |\n"
        "| static | 48.90 | 48.90 | 81.5 | 1825 | 1.35× |\n"
        "| adaptive | 47.60 | 47.60 | 79.3 | 1690 | 1.46× |\n"
        "| no cost | 50.00 | 50.00 | 83.3 | – | – |\n"
        "\n"
        "Scores in %. Average over arc. Retained: Average as a percentage of original's. Cost: wall time of the "
        "evaluation loop (model work, without task loading and scoring) on cpu, 1 thread, float32, grouped_mm "
        "experts. Speedup: original's Cost divided by the row's.\n"
    )


def test_cost_in_cpu_time():
    rows = [results("original", {"arc": 0.6}, cost={"seconds": 9.0, "cpu_seconds": 4.0, "device": "cpu", "threads": 1}),
            results("pruned", {"arc": 0.5}, cost={"seconds": 3.0, "cpu_seconds": 2.5, "device": "cpu", "threads": 1},
                    pruning=PRUNED)]
    table = report_table(rows, cost_time="cpu")
    assert table.splitlines()[0] == "| Model | arc | Average | Retained (%) | Cost (CPU s) | Speedup |"
    assert table.splitlines()[3] == "| pruned | 50.00 | 50.00 | 83.3 | 2.50 | 1.60× |"
    assert "Cost: process CPU time of the evaluation loop" in table
    assert report_table(rows).splitlines()[3] == "| pruned | 50.00 | 50.00 | 83.3 | 3.00 | 3.00× |"
    with pytest.raises(ValueError, match=r"cost_time must be one of \['cpu', 'wall'\], got 'gpu'"):
        report_table(rows, cost_time="gpu")


def test_cost_settings_that_differ_are_named_per_row():
    rows = [results("eager", {"arc": 0.6}, cost={"seconds": 1.25, "device": "cpu", "threads": 1},
                    model={"dtype": "float32", "experts_implementation": "eager"}),
            results("grouped", {"arc": 0.6}, cost={"seconds": 0.5, "device": "cpu", "threads": 1},
                    model={"dtype": "float32", "experts_implementation": "grouped_mm"})]
    table = report_table(rows)
    assert table.splitlines()[2:4] == ["| eager | 60.00 | 60.00 | 100.0 | 1.25 | 1.00× |",
                                       "| grouped | 60.00 | 60.00 | 100.0 | 0.500 | 2.50× |"]
    assert ("on eager: cpu, 1 thread, float32, eager experts; grouped: cpu, 1 thread, float32, grouped_mm experts."
            in table)


# ------------------------------------------------------------------------------- labels
def test_rows_without_a_label_are_named_after_their_recorded_plan():
    plan = {"method": "omp_normalized", "allocation": "loss", "ratio": 0.5, "model_id": "shipped:tiny-moe"}
    original = results(None, {"arc": 0.6}, model={"model": "shipped:tiny-moe", "base_model": "shipped:tiny-moe"})
    static = results(None, {"arc": 0.5}, pruning=PRUNED, model={"model": "outputs/tiny/model", "plan": plan})
    adaptive = results(None, {"arc": 0.5}, pruning=PRUNED,
                       model={"model": "outputs/tiny/model", "plan": plan, "adaptive": {"epsilon": 0.1}})
    rows = [line.split(" | ")[0] for line in report_table([original, static, adaptive]).splitlines()[2:5]]
    assert rows == ["| shipped:tiny-moe", "| shipped:tiny-moe (omp_normalized, loss, -50% experts)",
                    "| shipped:tiny-moe (omp_normalized, loss, -50% experts, OMP-MoE+ ε=0.1)"]


# ------------------------------------------------------------------------------- malformed files
def _without(data: dict, dotted: str) -> dict:
    data = copy.deepcopy(data)
    *parents, last = dotted.split(".")
    target = data
    for key in parents:
        target = target[key]
    del target[last]
    return data


FIX = "Re-create it with `ompmoe validate` / `ompmoe test` (LMEvalDataModule(output_path=...)), or restore that key."


@pytest.mark.parametrize("change, problem", [
    (lambda d: _without(d, "ompmoe.columns"), "has no key 'ompmoe.columns'"),
    (lambda d: _without(d, "ompmoe.scores"), "has no key 'ompmoe.scores'"),
    (lambda d: {**d, "ompmoe": {**d["ompmoe"], "scores": [0.5]}}, ": 'ompmoe.scores' must be an object, got list"),
    (lambda d: {**d, "ompmoe": {**d["ompmoe"], "model": "org/base"}}, ": 'ompmoe.model' must be an object, got str"),
    (lambda d: {**d, "ompmoe": {**d["ompmoe"], "columns": [{"source": "arc"}]}},
     ": 'ompmoe.columns[0]' must be an object with a string 'name'"),
    (lambda d: {**d, "config": ["tok"]}, ": 'config' must be an object, got list"),
    (lambda d: {**d, "n-samples": {"arc": 1000}}, ": 'n-samples.arc' must be an object, got int"),
    (lambda d: {**d, "n-samples": {"arc": {"effective": "1000"}}}, ": 'n-samples.arc.effective' must be an integer, got '1000'"),
    (lambda d: {**d, "group_subtasks": {"arc": "arc_easy"}}, ": 'group_subtasks.arc' must be a list, got str"),
])
def test_results_with_missing_keys_get_one_error_naming_file_key_and_fix(tmp_path, change, problem):
    good = write(tmp_path / "good.json", results("original", {"arc": 0.6}))
    bad = write(tmp_path / "bad.json", change(results("pruned", {"arc": 0.5}, pruning=PRUNED)))
    with pytest.raises(SystemExit) as error:
        main(["report", good, bad])
    assert str(error.value) == f"error: {bad}{'' if problem.startswith(':') else ' '}{problem}. {FIX}"


def test_plain_lm_eval_output_and_broken_json_are_refused_by_name(tmp_path):
    plain = write(tmp_path / "plain.json", {"results": {"arc": {"acc,none": 0.5}}})
    with pytest.raises(ResultsFileError, match=rf"^{plain} has no 'ompmoe' summary; it was not written by "):
        report_table([plain])
    broken = tmp_path / "broken.json"
    broken.write_text('{"ompmoe": ')
    with pytest.raises(ResultsFileError, match=rf"^{broken} is not JSON \(Expecting value: line 1 column 12"):
        report_table([broken])
    with pytest.raises(ResultsFileError, match=rf"^cannot read results file {tmp_path / 'nope.json'}: "
                                               "No such file or directory"):
        report_table([tmp_path / "nope.json"])


def test_eval_config_names_the_label_the_default_job_records():
    """configs/eval/tiny.yaml shows the label a checkpoint of configs/tiny.yaml gets: the plan that job runs."""
    import yaml

    from ompmoe.eval.labels import model_label

    configs = Path(__file__).resolve().parents[2] / "configs"
    job = yaml.safe_load((configs / "tiny.yaml").read_text())
    strategy = job["trainer"]["callbacks"][0]["init_args"]["strategy"]["init_args"]
    resolved = ompmoe.PruningStrategy(method=strategy["method"], allocation=strategy["allocation"]).resolved(
        "qwen3_moe")  # shipped:tiny-moe's architecture: the plan records what 'auto' resolved to
    label = model_label({
        "model": "outputs/tiny/model", "pruning": {"removed_fraction": strategy["ratio"]},
        "plan": {"method": resolved.method, "allocation": resolved.allocation, "model_id": job["model"]["model"]},
    })
    assert f'"{label}"' in (configs / "eval" / "tiny.yaml").read_text()
