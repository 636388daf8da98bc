"""Tokenizers for evaluation: the tiny models' byte-level vocabulary as a Hugging Face tokenizer.

lm-eval needs a Hugging Face tokenizer; the tiny models read UTF-8 bytes as token ids, and ids 0-2
(control bytes that do not occur in text) are their ``<pad>``, ``<s>`` and ``</s>``.
"""

from __future__ import annotations

from typing import Any

from ..data.sources import BYTES

SPECIAL_TOKENS = {0: "<pad>", 1: "<s>", 2: "</s>"}

SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""A minimal chat template (for byte-level test models, which have none)."""


def byte_tokenizer(chat_template: str | None = None, model_max_length: int | None = None) -> Any:
    """A ``PreTrainedTokenizerFast`` whose ids are UTF-8 bytes (vocabulary 256), for the tiny models.

    Args:
        chat_template: Jinja chat template to attach (default: none, like a base model);
            :data:`SIMPLE_CHAT_TEMPLATE` is a minimal one.
        model_max_length: Recorded as the tokenizer's ``model_max_length``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's table, inverted by ByteLevel

    table = bytes_to_unicode()
    vocab = {table[byte]: byte for byte in range(256) if byte not in SPECIAL_TOKENS}
    vocab.update({token: index for index, token in SPECIAL_TOKENS.items()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        name_or_path=BYTES,
        split_special_tokens=True,  # text always encodes to its own bytes, "<s>" included
        model_max_length=model_max_length,  # None: transformers' "unset"
    )
    if chat_template is not None:  # chat_template=None would be saved as "chat_template": null
        tokenizer.chat_template = chat_template
    return tokenizer


def load_tokenizer(name: str | Any, trust_remote_code: bool = False) -> Any:
    """A tokenizer from ``bytes`` (:func:`byte_tokenizer`), a hub id or a local path; instances as they are."""
    if not isinstance(name, str):
        return name
    if name == BYTES:
        return byte_tokenizer()
    from ..engine.export.config import load_tokenizer as auto_tokenizer  # reads non-uniform pruned checkpoints too

    try:
        return auto_tokenizer(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"Could not load a tokenizer from {name!r} ({error}). Pass the tokenizer explicitly "
            "(a hub id or local path; 'bytes' for the tiny byte-level models), e.g. --model.tokenizer."
        ) from error
