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
from ompmoe.eval.timing import Speedup, probe_indices, speedup

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
UNRATED_WHY = ("one run each, so its run-to-run spread is unknown. Results files written before the timing probe, or "
               "with fewer than 3 timed repeats, record no spread; evaluate again to rate it.\n")


def test_cost_and_speedup_of_old_files_without_repeated_timing_are_unrated():
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
        "| static | 48.90 | 48.90 | 81.5 | 1825 | 1.35× § |\n"
        "| adaptive | 47.60 | 47.60 | 79.3 | 1690 | 1.46× § |\n"
        "| no cost | 50.00 | 50.00 | 83.3 | – | – |\n"
        "\n"
        "Scores in %. Average over arc. Retained: Average as a percentage of original's. Cost: wall time of the "
        "evaluation loop (model work, without task loading and scoring) on cpu, 1 thread, float32, grouped_mm "
        "experts. § Speedup unrated for static, adaptive (no repeated timing recorded): original's Cost divided by "
        "the row's, " + UNRATED_WHY
    )
    # Only the baseline has a cost: nothing is unrated, the note says what the column would hold.
    alone = report_table(rows[:1] + rows[3:])
    assert alone.endswith("experts. Speedup: original's Cost divided by the row's.\n")


def test_cost_in_cpu_time():
    rows = [results("original", {"arc": 0.6}, cost={"seconds": 9.0, "cpu_seconds": 4.0, "device": "cpu", "threads": 1}),
            results("pruned", {"arc": 0.5}, cost={"seconds": 3.0, "cpu_seconds": 2.5, "device": "cpu", "threads": 1},
                    pruning=PRUNED)]
    table = report_table(rows, cost_time="cpu")
    assert table.splitlines()[0] == "| Model | arc | Average | Retained (%) | Cost (CPU s) | Speedup |"
    assert table.splitlines()[3] == "| pruned | 50.00 | 50.00 | 83.3 | 2.50 | 1.60× § |"
    assert "Cost: process CPU time of the evaluation loop" in table
    assert report_table(rows).splitlines()[3] == "| pruned | 50.00 | 50.00 | 83.3 | 3.00 | 3.00× § |"
    with pytest.raises(ValueError, match=r"cost_time must be one of \['cpu', 'wall'\], got 'gpu'"):
        report_table(rows, cost_time="gpu")


def test_cost_settings_that_differ_are_named_per_row():
    rows = [results("eager", {"arc": 0.6}, cost={"seconds": 1.25, "device": "cpu", "threads": 1},
                    model={"dtype": "float32", "experts_implementation": "eager"}),
            results("grouped", {"arc": 0.6}, cost={"seconds": 0.5, "device": "cpu", "threads": 1},
                    model={"dtype": "float32", "experts_implementation": "grouped_mm"})]
    table = report_table(rows)
    assert table.splitlines()[2:4] == ["| eager | 60.00 | 60.00 | 100.0 | 1.25 | 1.00× |",
                                       "| grouped | 60.00 | 60.00 | 100.0 | 0.500 | 2.50× § |"]
    assert ("on eager: cpu, 1 thread, float32, eager experts; grouped: cpu, 1 thread, float32, grouped_mm experts."
            in table)


# ------------------------------------------------------------------------------- repeated timing
def timing(wall: list, cpu: list | None = None, inputs: str = "0123abcd", warmup: int = 1) -> dict:
    """``ompmoe.cost.timing`` as EvalModule records it (the report reads the repeats, not the summaries)."""
    return {"repeats": len(wall), "warmup": warmup, "batches": 8, "tokens": 2048, "inputs": inputs,
            "seconds": wall, "cpu_seconds": wall if cpu is None else cpu}


BASE_WALL = [10.0, 10.4, 11.0, 10.2, 10.6]
FAST_WALL = [7.9, 8.1, 8.0, 8.4, 7.8]


def timed_rows(*walls: list, **kwargs) -> list[dict]:
    settings = {"device": "cpu", "threads": 1, "ranks": 1}
    labels = ["original", "static", "adaptive", "other"]
    return [results(label, {"arc": 0.6 - 0.05 * index}, pruning=PRUNED if index else None,
                    cost={"seconds": 3.0 * sum(wall), "cpu_seconds": 2.0 * sum(wall), "timing": timing(wall, **kwargs),
                          **settings}, model={"dtype": "float32", "experts_implementation": "eager"})
            for index, (label, wall) in enumerate(zip(labels, walls))]


def test_speedup_interval_is_the_ratio_of_medians_and_of_the_extreme_repeats():
    found = speedup(BASE_WALL, FAST_WALL)
    # Literally: medians 10.4 and 8.0; slowest baseline repeat over fastest row repeat and the other way round.
    assert (found.value, found.low, found.high) == (10.4 / 8.0, 10.0 / 8.4, 11.0 / 7.8)
    assert found.significant and str(found) == "1.30× (1.19-1.41)"
    # Significant needs both: the interval excludes 1, and its half-width is below the distance from 1.
    assert not Speedup(1.05, 0.98, 1.12).significant  # straddles 1
    assert not Speedup(1.02, 1.005, 1.43).significant  # excludes 1, but half-width 0.21 >= 0.02
    assert Speedup(0.80, 0.75, 0.86).significant  # a significant slowdown is a number too
    assert not Speedup(1.0, 1.0, 1.0).significant  # no spread at all, and no speedup either
    assert probe_indices(20, 8) == [0, 3, 5, 8, 11, 14, 16, 19]
    assert probe_indices(5, 8) == [0, 1, 2, 3, 4] and probe_indices(9, 1) == [4] and probe_indices(0, 8) == []


def test_report_prints_the_speedup_with_its_interval_or_refuses_it(tmp_path, capsys):
    straddles = [10.1, 9.7, 10.9, 10.3, 9.9]  # median 10.1: 1.03x, interval 10.0/10.9 .. 11.0/9.7
    files = [write(tmp_path / f"{index}.json", row)
             for index, row in enumerate(timed_rows(BASE_WALL, straddles, FAST_WALL))]
    main(["report", *files])
    lines = capsys.readouterr().out.splitlines()
    assert lines[:5] == [
        "| Model | arc | Average | Retained (%) | Cost (s) | Speedup |",
        "|---|---:|---:|---:|---:|---:|",
        "| original | 60.00 | 60.00 | 100.0 | 157 | 1.00× |",
        "| static | 55.00 | 55.00 | 91.7 | 153 | n.s. |",
        "| adaptive | 50.00 | 50.00 | 83.3 | 121 | 1.30× (1.19-1.41) |",
    ]
    assert lines[6] == (
        "Scores in %. Average over arc. Retained: Average as a percentage of original's. Cost: wall time of the "
        "evaluation loop (model work, without task loading and scoring) on cpu, 1 thread, float32, eager experts. "
        "Speedup: original's median wall time over the repeats of its timing probe (8 batches, 2048 tokens, run "
        "again after the loop: 1 warm-up pass, then 5 timed repeats) divided by the row's, not the ratio of the Cost "
        "columns (one pass each, warm-up included); in parentheses the lowest and highest ratio of one original "
        "repeat to one row repeat. n.s.: speedup not told apart from 1.00× (its interval includes 1.00, or its "
        f"half-width is not smaller than its distance from 1): static {speedup(BASE_WALL, straddles)}.")
    assert str(speedup(BASE_WALL, straddles)) == "1.03× (0.92-1.13)"


def test_speedup_in_cpu_time_uses_the_cpu_repeats():
    rows = timed_rows(BASE_WALL, BASE_WALL)
    rows[1]["ompmoe"]["cost"]["timing"]["cpu_seconds"] = [value / 2 for value in BASE_WALL]
    assert report_table(rows).splitlines()[3].endswith(" | n.s. |")  # same wall times: no speedup
    assert report_table(rows, cost_time="cpu").splitlines()[3].endswith(" | 2.00× (1.82-2.20) |")


def test_speedup_against_an_old_file_or_other_probe_inputs_is_unrated():
    rows = timed_rows(BASE_WALL, FAST_WALL, FAST_WALL, FAST_WALL)
    del rows[1]["ompmoe"]["cost"]["timing"]  # written before the timing probe
    rows[2]["ompmoe"]["cost"]["timing"]["seconds"] = FAST_WALL[:2]  # too few repeats
    rows[3]["ompmoe"]["cost"]["timing"]["inputs"] = "ffff0000"  # another batch size or limit: other batches
    table = report_table(rows)
    ratio = sum(BASE_WALL) / sum(FAST_WALL)
    assert [line.split(" | ")[-1] for line in table.splitlines()[2:6]] == [
        "1.00× |", f"{ratio:.2f}× § |", f"{ratio:.2f}× § |", f"{ratio:.2f}× § |"]
    assert table.endswith(
        "§ Speedup unrated for static, adaptive (no repeated timing recorded); other (its timing probe ran other "
        "inputs than original's): original's Cost divided by the row's, " + UNRATED_WHY)
    # The baseline without repeated timing: every row is unrated, and no row is called n.s.
    del rows[0]["ompmoe"]["cost"]["timing"]
    table = report_table(rows)
    assert "n.s." not in table and "Speedup: original's median" not in table
    assert "§ Speedup unrated for static, adaptive (no repeated timing recorded); other (original has no repeated " \
           "timing): " in table


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
    (lambda d: {**d, "ompmoe": {**d["ompmoe"], "cost": {"seconds": 1.0, "timing": [1.0]}}},
     ": 'ompmoe.cost.timing' must be an object, got list"),
    (lambda d: {**d, "ompmoe": {**d["ompmoe"], "cost": {"seconds": 1.0, "timing": {"seconds": 1.0}}}},
     ": 'ompmoe.cost.timing.seconds' must be a list, got float"),
    (lambda d: {**d, "ompmoe": {**d["ompmoe"], "cost": {"seconds": 1.0, "timing": {"cpu_seconds": [1.0, "2"]}}}},
     ": 'ompmoe.cost.timing.cpu_seconds[1]' must be a finite number of seconds >= 0, got '2'"),
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
