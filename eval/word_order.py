"""``ompmoe_word_order``: an offline multiple-choice task that ``shipped:tiny-moe`` does well above chance.

Each item: :data:`CONTEXT_WORDS` words of a held-out corpus document (never trained on), then four orders of the
next :data:`ANSWER_WORDS` words, the real one and three adjacent swaps: the same words, so only order tells them
apart. Deterministic (no random numbers); how items are picked and the model's scores: docs/evaluation.md.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

CONTEXT_WORDS = 20
"""Words of context before the four-word answer."""
ANSWER_WORDS = 4
"""Words in each choice."""
PER_DOCUMENT = {"prose": 3, "code": 6}
"""Most items per document (the code split has fewer, longer documents)."""
PER_DOMAIN = 100
"""Items per domain (200 in all)."""

_WORD = re.compile(r"\S+")


def _swapped(words: list[str], index: int) -> str:
    """``words`` (each with its leading whitespace) joined, with words ``index`` and ``index + 1`` exchanged."""
    spaces = [word[: len(word) - len(word.lstrip())] for word in words]
    bare = [word.lstrip() for word in words]
    bare[index], bare[index + 1] = bare[index + 1], bare[index]
    return "".join(space + word for space, word in zip(spaces, bare))


def document_items(text: str, per_document: int) -> list[tuple[str, list[str]]]:
    """``(context, [right answer, swap 1-2, swap 2-3, swap 3-4])`` of one document, at most ``per_document``."""
    spans = [match.span() for match in _WORD.finditer(text)]
    free = len(spans) - CONTEXT_WORDS - ANSWER_WORDS
    if free < 0 or per_document <= 0:
        return []
    step = max(CONTEXT_WORDS + ANSWER_WORDS, free // per_document)
    items = []
    for start in range(CONTEXT_WORDS, len(spans) - ANSWER_WORDS + 1, step):
        if len(items) == per_document:
            break
        context = text[spans[start - CONTEXT_WORDS][0]:spans[start - 1][1]]
        words = [text[spans[index - 1][1]:spans[index][1]] for index in range(start, start + ANSWER_WORDS)]
        choices = ["".join(words), *(_swapped(words, index) for index in range(ANSWER_WORDS - 1))]
        if len(set(choices)) == len(choices):
            items.append((context, choices))
    return items


def word_order_docs(per_domain: int = PER_DOMAIN) -> list[dict[str, Any]]:
    """The task's documents: ``{"id", "domain", "context", "choices", "label"}``, prose first, then code."""
    from ompmoe.data import CORPUS_DOMAINS, corpus_documents

    docs: list[dict[str, Any]] = []
    for domain in CORPUS_DOMAINS:
        items = ((document["id"], *item) for document in corpus_documents(domain, "heldout")
                 for item in document_items(document["text"], PER_DOCUMENT[domain]))
        for found, (document_id, context, choices) in enumerate(itertools.islice(items, per_domain)):
            label = len(docs) % len(choices)
            right, *swaps = choices
            docs.append({"id": f"{domain}:{document_id}:{found}", "domain": domain, "context": context,
                         "choices": swaps[:label] + [right] + swaps[label:], "label": label})
    return docs


def dataset(**_: Any) -> Any:
    """lm-eval's ``custom_dataset``: the documents as the ``test`` split."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(word_order_docs())})
