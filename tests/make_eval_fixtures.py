"""Write small local copies of the paper suites' hub data sets, in each data set's own schema.

Why: the hub cannot be reached in CI, yet the suites' real lm-eval task definitions (prompt
templates, ``process_docs``, filters, regexes, group aggregation, LongBench's metrics) must run
through the bridge. Every copy here is laid out like a hub snapshot (``<root>/<owner>/<name>/``
with a ``README.md`` ``configs:`` block and one JSON-lines file per config and split), so
``LMEvalDataModule(data_dir=<root>)`` reads it in place of the hub data set, with lm-eval's own
task YAMLs unchanged. Same config names, split names, column names and value types as the hub
data sets; the text is generated here (templates and arithmetic), not copied from them.

Run ``python tests/make_eval_fixtures.py <root>`` to write them; the tests call :func:`write_all`.
:data:`ANSWERS` gives, per task, a right and a wrong model response for the first test row (the
stub-model tests score them through the real filters and metrics).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

ROWS = 2  # rows per split (per subject/subtask); the gsm8k train split gets 6 for its 5 shots

MMLU_SUBJECTS = (
    "abstract_algebra", "anatomy", "astronomy", "business_ethics", "clinical_knowledge", "college_biology",
    "college_chemistry", "college_computer_science", "college_mathematics", "college_medicine", "college_physics",
    "computer_security", "conceptual_physics", "econometrics", "electrical_engineering", "elementary_mathematics",
    "formal_logic", "global_facts", "high_school_biology", "high_school_chemistry", "high_school_computer_science",
    "high_school_european_history", "high_school_geography", "high_school_government_and_politics",
    "high_school_macroeconomics", "high_school_mathematics", "high_school_microeconomics", "high_school_physics",
    "high_school_psychology", "high_school_statistics", "high_school_us_history", "high_school_world_history",
    "human_aging", "human_sexuality", "international_law", "jurisprudence", "logical_fallacies", "machine_learning",
    "management", "marketing", "medical_genetics", "miscellaneous", "moral_disputes", "moral_scenarios", "nutrition",
    "philosophy", "prehistory", "professional_accounting", "professional_law", "professional_medicine",
    "professional_psychology", "public_relations", "security_studies", "sociology", "us_foreign_policy", "virology",
    "world_religions",
)

BBH_YES_NO = {"causal_judgement": ("Yes", "No"), "navigate": ("Yes", "No"), "web_of_lies": ("Yes", "No"),
              "sports_understanding": ("yes", "no")}
BBH_MC = {  # subtask -> number of options
    "date_understanding": 6, "disambiguation_qa": 3, "geometric_shapes": 10, "hyperbaton": 2,
    "logical_deduction_five_objects": 5, "logical_deduction_seven_objects": 7, "logical_deduction_three_objects": 3,
    "movie_recommendation": 4, "penguins_in_a_table": 5, "reasoning_about_colored_objects": 18, "ruin_names": 4,
    "salient_translation_error_detection": 6, "snarks": 2, "temporal_sequences": 4,
    "tracking_shuffled_objects_five_objects": 5, "tracking_shuffled_objects_seven_objects": 7,
    "tracking_shuffled_objects_three_objects": 3,
}
BBH_SUBTASKS = tuple(sorted((*BBH_YES_NO, *BBH_MC, "boolean_expressions", "dyck_languages", "formal_fallacies",
                             "multistep_arithmetic_two", "object_counting", "word_sorting")))

LONGBENCH = {  # config -> language. Columns as lm-eval's longbench YAMLs read them (question, context, answers, all_classes)
    "narrativeqa": "en", "qasper": "en", "multifieldqa_en": "en", "multifieldqa_zh": "zh", "hotpotqa": "en",
    "2wikimqa": "en", "musique": "en", "dureader": "zh", "gov_report": "en", "qmsum": "en", "multi_news": "en",
    "vcsum": "zh", "trec": "en", "triviaqa": "en", "samsum": "en", "lsht": "zh", "passage_count": "en",
    "passage_retrieval_en": "en", "passage_retrieval_zh": "zh", "lcc": "python", "repobench-p": "python",
}
WORDS = ("river", "stone", "lamp", "garden", "violin", "copper", "meadow", "harbor", "pencil", "falcon", "orchard",
         "ladder", "canyon", "button", "glacier", "marble", "tunnel", "velvet", "anchor", "blossom")
ZH = "山水花鸟月光书房茶叶钟声城市河流"

ANSWERS: dict[str, tuple[str, str]] = {}
"""task -> (right response, wrong response) for the first test row of its fixture."""


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _write(root: Path, repo: str, configs: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """``configs``: config name -> split -> rows, written as a hub snapshot with a README ``configs:`` block."""
    base = root / repo
    lines = ["---", "configs:"]
    for config, splits in configs.items():
        lines.append(f"- config_name: {config}")
        lines.append("  data_files:")
        for split, rows in splits.items():
            path = base / config / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
            lines += [f"  - split: {split}", f"    path: {config}/{split}.jsonl"]
    lines += ["---", f"Generated fixture of {repo} (tests/make_eval_fixtures.py); not the real data set.", ""]
    (base / "README.md").write_text("\n".join(lines), encoding="utf-8")


def _labeled_choices(rng: random.Random, n: int, labels: str = "ABCD") -> dict[str, list[str]]:
    return {"text": [_words(rng, 2) for _ in range(n)], "label": list(labels[:n])}


def arc(root: Path, rng: random.Random) -> None:
    configs = {}
    for config in ("ARC-Challenge", "ARC-Easy"):
        configs[config] = {
            split: [{"id": f"{config}-{split}-{i}", "question": f"Which {_words(rng, 1)} goes with the {_words(rng, 2)}?",
                     "choices": _labeled_choices(rng, 4), "answerKey": "ABCD"[i % 4]} for i in range(ROWS)]
            for split in ("train", "test", "validation")
        }
    _write(root, "allenai/ai2_arc", configs)


def boolq(root: Path, rng: random.Random) -> None:
    _write(root, "aps/super_glue", {"boolq": {
        split: [{"question": f"is the {_words(rng, 1)} near the {_words(rng, 1)}", "passage": _words(rng, 12) + ".",
                 "idx": i, "label": i % 2} for i in range(ROWS)]
        for split in ("train", "validation", "test")}})


def hellaswag(root: Path, rng: random.Random) -> None:
    def row(i: int, split: str) -> dict[str, Any]:
        ctx_a, ctx_b = f"A person walks to the {_words(rng, 1)}.", f"then [title] they pick up a {_words(rng, 1)}"
        return {"ind": i, "activity_label": "Walking the " + _words(rng, 1), "ctx_a": ctx_a, "ctx_b": ctx_b,
                "ctx": ctx_a + " " + ctx_b, "endings": [f"and [step] carry the {_words(rng, 2)}." for _ in range(4)],
                "source_id": f"activitynet~v_{i}", "split": split, "split_type": "indomain", "label": str(i % 4)}

    _write(root, "Rowan/hellaswag", {"default": {s: [row(i, s) for i in range(ROWS)] for s in ("train", "validation", "test")}})


def mmlu(root: Path, rng: random.Random) -> None:
    configs = {}
    for subject in MMLU_SUBJECTS:
        configs[subject] = {
            split: [{"question": f"In {subject.replace('_', ' ')}, which {_words(rng, 1)} comes first?",
                     "subject": subject, "choices": [_words(rng, 2) for _ in range(4)], "answer": (i + len(subject)) % 4}
                    for i in range(ROWS)]
            for split in ("test", "validation", "dev")
        }
    _write(root, "cais/mmlu", configs)


def openbookqa(root: Path, rng: random.Random) -> None:
    _write(root, "allenai/openbookqa", {"main": {
        split: [{"id": f"{split}-{i}", "question_stem": f"A {_words(rng, 1)} is used to", "choices": _labeled_choices(rng, 4),
                 "answerKey": "ABCD"[(i + 1) % 4]} for i in range(ROWS)]
        for split in ("train", "validation", "test")}})


def rte(root: Path, rng: random.Random) -> None:
    _write(root, "nyu-mll/glue", {"rte": {
        split: [{"sentence1": f"The {_words(rng, 1)} was found beside the {_words(rng, 1)}.",
                 "sentence2": f"A {_words(rng, 1)} was found.", "label": i % 2, "idx": i} for i in range(ROWS)]
        for split in ("train", "validation", "test")}})


def winogrande(root: Path, rng: random.Random) -> None:
    def row(i: int) -> dict[str, Any]:
        a, b = rng.sample(WORDS, 2)
        return {"sentence": f"The {a} did not fit in the {b} because the _ was too small.", "option1": a, "option2": b,
                "answer": "12"[i % 2]}

    _write(root, "allenai/winogrande", {"winogrande_xl": {s: [row(i) for i in range(ROWS)] for s in ("train", "validation", "test")}})


def gsm8k(root: Path, rng: random.Random) -> None:
    def row() -> dict[str, Any]:
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        return {"question": f"Ann has {a} {rng.choice(WORDS)}s and buys {b} more. How many does she have now?",
                "answer": f"She has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} now.\n#### {a + b}"}

    splits = {"train": [row() for _ in range(6)], "test": [row() for _ in range(ROWS)]}
    total = splits["test"][0]["answer"].rsplit("#### ", 1)[1]
    ANSWERS["gsm8k"] = (f"Adding them gives {total}.\n#### {total}", f"Adding them gives {int(total) + 1}.\n#### {int(total) + 1}")
    _write(root, "openai/gsm8k", {"main": splits})


def _bbh_row(rng: random.Random, subtask: str, i: int) -> tuple[dict[str, str], str]:
    """A test row and a wrong answer for it."""
    if subtask == "boolean_expressions":
        value = rng.choice([True, False])
        return {"input": f"not ( {not value} ) and True is", "target": str(value)}, str(not value)
    if subtask in BBH_YES_NO:
        yes, no = BBH_YES_NO[subtask]
        target = (yes, no)[i % 2]
        return {"input": f"Is the {_words(rng, 1)} taller than the {_words(rng, 1)}?", "target": target}, (no if target == yes else yes)
    if subtask in BBH_MC:
        n = BBH_MC[subtask]
        options = "\n".join(f"({chr(65 + k)}) {_words(rng, 2)}" for k in range(n))
        target = chr(65 + (i % n))
        wrong = chr(65 + ((i + 1) % n))
        return {"input": f"Which option names the {_words(rng, 1)}?\nOptions:\n{options}", "target": f"({target})"}, f"({wrong})"
    if subtask == "dyck_languages":
        return {"input": "Complete the rest of the sequence, making sure that the parentheses are closed properly. "
                         "Input: [ < ( )", "target": "> ]"}, "] >"
    if subtask == "formal_fallacies":
        target = ("valid", "invalid")[i % 2]
        return {"input": f"Every {_words(rng, 1)} is a {_words(rng, 1)}. Is the argument valid or invalid?",
                "target": target}, ("invalid" if target == "valid" else "valid")
    if subtask in ("multistep_arithmetic_two", "object_counting"):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return {"input": f"(({a} + {b}) * 1) =", "target": str(a + b)}, str(a + b + 1)
    if subtask == "word_sorting":
        words = rng.sample(WORDS, 4)
        return {"input": "Sort the following words alphabetically: List: " + " ".join(words),
                "target": " ".join(sorted(words))}, " ".join(sorted(words, reverse=True))
    raise KeyError(subtask)


def bbh(root: Path, rng: random.Random) -> None:
    configs = {}
    for subtask in BBH_SUBTASKS:
        rows = [_bbh_row(rng, subtask, i) for i in range(ROWS)]
        configs[subtask] = {"test": [row for row, _ in rows]}
        ANSWERS[f"bbh_zeroshot_{subtask}"] = (rows[0][0]["target"], rows[0][1])
    _write(root, "SaylorTwift/bbh", configs)


def longbench(root: Path, rng: random.Random) -> None:
    configs = {}
    for config, language in LONGBENCH.items():
        rows = []
        for i in range(ROWS):
            if language == "zh":
                answer, wrong = "".join(rng.sample(ZH, 4)), "甲乙丙丁"
                context = "".join(rng.choice(ZH) for _ in range(60)) + answer
            elif language == "python":
                answer, wrong = f"    return {rng.choice(WORDS)}_{i} + 1", "~~~~"
                context = f"def f_{i}(x):\n    y = x * 2\n"
            else:
                answer, wrong = _words(rng, 3), "zzz qqq"
                context = _words(rng, 40) + ". " + answer + "."
            all_classes = None
            if config in ("trec", "lsht"):
                all_classes = ["Location", "Number", "Person"] if language == "en" else ["体育", "财经", "科技"]
                answer, wrong = all_classes[i % 3], all_classes[(i + 1) % 3]
            if config.startswith("passage_retrieval"):
                answer, wrong = ("Paragraph 2", "Paragraph 1") if language == "en" else ("段落2", "段落1")
            if config == "passage_count":
                answer, wrong = "3", "5"
            rows.append({"question": f"What is said about the {_words(rng, 1)}?", "context": context, "answers": [answer],
                         "length": len(context.split()), "dataset": config, "language": language,
                         "all_classes": all_classes, "_id": f"{config}-{i:04d}"})
            if i == 0:
                ANSWERS[f"longbench_{config}"] = (answer, wrong)
        configs[config] = {"test": rows}
    _write(root, "Xnhyacinth/LongBench", configs)


WRITERS = {"arc": arc, "boolq": boolq, "hellaswag": hellaswag, "mmlu": mmlu, "openbookqa": openbookqa, "rte": rte,
           "winogrande": winogrande, "gsm8k": gsm8k, "bbh": bbh, "longbench": longbench}


def write_all(root: str | Path, seed: int = 0) -> Path:
    """Write every fixture data set under ``root`` (deterministic for a seed); returns ``root``."""
    root = Path(root)
    for name, writer in WRITERS.items():
        writer(root, random.Random(f"{seed}-{name}"))
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/make_eval_fixtures.py <output directory>")
    print(write_all(sys.argv[1]))
