"""Functions of ompmoe's lm-eval task configs (loaded by path by lm-eval; the logic lives in ompmoe.eval)."""

from ompmoe.eval.humaneval import execute as humaneval_execute  # noqa: F401
from ompmoe.eval.humaneval import load_dataset as humaneval_dataset  # noqa: F401
from ompmoe.eval.humaneval import process_results as humaneval_process_results  # noqa: F401

C4_DOCUMENTS = 1100


def _one_document(texts, separator):
    import datasets

    return datasets.Dataset.from_dict({"text": [separator.join(texts)]})


def wikitext2_document(dataset):
    """All rows of the split joined with a blank line (GPTQ/SparseGPT's WikiText-2 text)."""
    return _one_document(dataset["text"], "\n\n")


def c4_document(dataset):
    """The first 1100 documents joined with a space (GPTQ's C4 evaluation text)."""
    return _one_document(dataset.select(range(min(C4_DOCUMENTS, len(dataset))))["text"], " ")
