"""lm-eval requests -> token-level work items -> batches; model results -> lm-eval responses.

:class:`RequestEncoder` tokenizes lm-eval's ``Instance`` objects exactly as ``HFLM`` does, so metrics equal
``HFLM``'s; :class:`WorkPlan` turns them into *score items* (items sharing a model input share a batch row, like
``HFLM``'s logits cache) and *generate items*, batched once, longest first, one kind per batch, for a
``DistributedSampler`` to deal to ranks.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

SCORE = "score"
GENERATE = "generate"
ROLLING = "loglikelihood_rolling"
LOGLIKELIHOOD = "loglikelihood"
GENERATE_UNTIL = "generate_until"

DEFAULT_MAX_LENGTH = 2048  # lm-eval's default when neither the config nor the tokenizer says
DEFAULT_MAX_GEN_TOKS = 256  # HFLM's


def resolve_max_length(config: Any, tokenizer: Any = None, default: int = DEFAULT_MAX_LENGTH) -> int:
    """The model's context length as ``HFLM`` resolves it: config, then tokenizer, then ``default``."""
    config = getattr(config, "text_config", None) or config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, attr, None)
        if value is not None:
            return int(value)
    model_max_length = getattr(tokenizer, "model_max_length", None)
    if model_max_length is not None and model_max_length < int(1e29):  # transformers' "unset" sentinel
        return int(model_max_length)
    return default


class RequestEncoder:
    """The tokenizer side of lm-eval's ``HFLM``: builds requests' contexts and token ids, runs no model.

    :meth:`create` makes ``TemplateLM`` objects, so lm-eval can also apply chat templates with them. The
    arguments are ``HFLM``'s; ``max_gen_toks`` is the generation length of tasks that do not set one.
    """

    @classmethod
    def create(cls, tokenizer: Any, max_length: int, **kwargs: Any) -> Any:
        """A new encoder (an lm-eval ``TemplateLM``, imported here as lm-eval is optional)."""
        from lm_eval.api.model import TemplateLM

        return type("RequestEncoderLM", (cls, TemplateLM), {})(tokenizer, max_length, **kwargs)

    def __init__(
        self,
        tokenizer: Any,
        max_length: int,
        *,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        add_bos_token: bool | None = None,
        chat_template_args: Mapping[str, Any] | None = None,
        think_end_token: str | int | None = None,
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.chat_template_args = dict(chat_template_args or {})
        self.think_end_token = think_end_token

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.eos_token_id if self.tokenizer.bos_token_id is None else self.tokenizer.bos_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        kwargs = {}
        if add_special_tokens is not None:
            kwargs["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            kwargs["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and _has_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kwargs["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **kwargs)
        if left_truncate_len:
            encoding = encoding[-left_truncate_len:]
        return encoding

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        import jinja2

        kwargs = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                      continue_final_message=not add_generation_prompt, **self.chat_template_args)
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kwargs)
        except jinja2.exceptions.TemplateError:  # as HFLM: retry without the system turn
            chat_history = [message for message in chat_history if message["role"] != "system"]
            return self.tokenizer.apply_chat_template(chat_history, **kwargs)

    def _loglikelihood_tokens(self, requests: list, **kwargs: Any) -> list[tuple[list[int], list[int]]]:
        # TemplateLM.loglikelihood tokenizes the pairs as HFLM and calls this: keep the encodings.
        return [(list(context), list(continuation)) for _, context, continuation in requests]

    def encode_rolling(self, text: str) -> list[tuple[list[int], list[int]]]:
        """The disjoint ``(context, prediction)`` windows of a rolling-loglikelihood request."""
        from lm_eval import utils

        windows = utils.get_rolling_token_windows(
            token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
            context_len=1,
        )
        return [tuple(map(list, utils.make_disjoint_window(window))) for window in windows]

    def generation_spec(self, gen_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Normalized generation kwargs (``until`` with EOS, ``max_gen_toks``, HF generate kwargs)."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks))
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        kwargs.pop("max_length", None)
        if kwargs.get("do_sample") is False and kwargs.get("temperature", 0.0) == 0.0:
            kwargs.pop("temperature", None)
        return {"until": until, "max_gen_toks": max_gen_toks, "generate_kwargs": kwargs}

    def encode_generation(self, context: str, gen_kwargs: Mapping[str, Any]) -> tuple[list[int], dict[str, Any]]:
        """The context as ``HFLM.tok_batch_encode`` encodes it (one string, no padding), and its generation spec."""
        spec = self.generation_spec(gen_kwargs)
        max_ctx_len = self.max_length - spec["max_gen_toks"]
        if max_ctx_len <= 0:
            raise ValueError(
                f"Generation asks for {spec['max_gen_toks']} new tokens but the model's context is only "
                f"{self.max_length} tokens; raise max_length or lower max_gen_toks."
            )
        kwargs: dict[str, Any] = {}
        if _has_prefix(context, getattr(self.tokenizer, "bos_token", None)):
            kwargs["add_special_tokens"] = False
        elif self.add_bos_token is not None:
            kwargs["add_special_tokens"] = self.add_bos_token
        return list(self.tokenizer(context, truncation=False, **kwargs)["input_ids"][-max_ctx_len:]), spec

    def decode_generation(self, tokens: Sequence[int], until: Sequence[str]) -> str:
        """Generated token ids -> the response lm-eval scores (``HFLM``'s post-processing)."""
        from lm_eval.models.utils import postprocess_generated_text

        tokens = list(tokens)
        if isinstance(self.think_end_token, int):
            positions = [i for i, token in enumerate(tokens) if token == self.think_end_token]
            if positions:
                tokens = tokens[positions[-1] + 1:]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if isinstance(self.think_end_token, int):
            text = text.lstrip()
        return postprocess_generated_text(
            generation=text, stop=list(until),
            think_end_token=self.think_end_token if isinstance(self.think_end_token, str) else None,
        )

    def generate_until(self, requests: Any, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("RequestEncoder only encodes requests; the EvalModule runs the model.")

    loglikelihood_rolling = generate_until  # lm-eval's abstract model calls: this object never runs a model


def _has_prefix(text: str, prefix: str | None) -> bool:
    return bool(prefix) and text.startswith(prefix)


def make_replay_lm(responses: Mapping[int, list[Any]]) -> Any:
    """An lm-eval ``LM`` answering each request with its computed responses (``id(instance)`` -> one per repeat)."""
    from lm_eval.api.model import LM

    class ReplayLM(LM):
        tokenizer_name = ""  # evaluate() reads it for chat tasks to build requests; ours were built in setup()

        def __init__(self) -> None:
            super().__init__()
            self._queues = {key: list(values) for key, values in responses.items()}

        def _replay(self, requests: list[Any]) -> list[Any]:
            out = []
            for instance in requests:
                queue = self._queues.get(id(instance))
                if not queue:
                    raise RuntimeError(
                        f"No response was computed for a {instance.request_type} request of task "
                        f"{instance.task_name!r} (doc {instance.doc_id}); the request plan and lm-eval disagree."
                    )
                out.append(queue.pop(0))
            return out

        loglikelihood = loglikelihood_rolling = generate_until = _replay

    return ReplayLM()


@dataclass
class Request:
    """One response lm-eval expects: an ``Instance`` (once per repeat) and the items that answer it."""

    group: int  # index of the request group (suite) the instance belongs to
    instance: Any
    items: list[int]
    num_tokens: int = 0  # predicted tokens of a rolling request (token-level perplexity)
    generation_until: list[str] | None = None  # stop sequences of a generate request (for decoding)


@dataclass
class WorkPlan:
    """All model work of an evaluation: score and generate items, and the requests they answer.

    Item ids are positions in :attr:`items`, deterministic given the instances, so all ranks agree on them.
    """

    requests: list[Request] = field(default_factory=list)
    items: list[tuple] = field(default_factory=list)  # (SCORE, input, continuation) | (GENERATE, context, spec)
    _index: dict[Any, int] = field(default_factory=dict)

    def _item(self, key: tuple, dedupe: bool = True) -> int:
        if dedupe and key in self._index:
            return self._index[key]
        self.items.append(key)
        if dedupe:
            self._index[key] = len(self.items) - 1
        return len(self.items) - 1

    def _score_item(self, context: list[int], continuation: list[int], max_length: int) -> int:
        if not context or not continuation:
            raise ValueError("A scored request needs a non-empty context and continuation.")
        if len(continuation) > max_length:
            raise ValueError(f"A continuation of {len(continuation)} tokens exceeds max_length={max_length}.")
        model_input = tuple((context + continuation)[-(max_length + 1):][:-1])
        return self._item((SCORE, model_input, tuple(continuation)))

    def add(self, group: int, instances: Sequence[Any], encoder: Any) -> None:
        """Encode ``instances`` (one request type or mixed) and add their requests, in order."""
        loglikelihood = [inst for inst in instances if inst.request_type == LOGLIKELIHOOD]
        encoded = iter(encoder.loglikelihood(loglikelihood, disable_tqdm=True))  # encodings: _loglikelihood_tokens
        for instance in instances:
            kind, tokens, until = instance.request_type, 0, None
            if kind == LOGLIKELIHOOD:
                items = [self._score_item(*next(encoded), encoder.max_length)]
            elif kind == ROLLING:
                windows = encoder.encode_rolling(instance.args[0])
                items = [self._score_item(context, prediction, encoder.max_length) for context, prediction in windows]
                tokens = sum(len(prediction) for _, prediction in windows)
            elif kind == GENERATE_UNTIL:
                tokens_in, spec = encoder.encode_generation(instance.args[0], instance.args[1])
                key = (GENERATE, tuple(tokens_in), json.dumps(spec, sort_keys=True, default=str))
                sampled = bool(spec["generate_kwargs"].get("do_sample"))
                until = list(spec["until"])
            else:
                raise ValueError(f"Unsupported lm-eval request type {kind!r} (task {instance.task_name!r}).")
            for _ in range(max(1, int(instance.repeats or 1))):
                if kind == GENERATE_UNTIL:
                    items = [self._item(key, dedupe=not sampled)]
                self.requests.append(Request(group, instance, list(items), tokens, until))

    def batches(self, batch_size: int, max_batch_tokens: int | None = None, pad_token_id: int = 0,
                world_size: int = 1) -> list[dict]:
        """Homogeneous batches, longest first: score rows (one per distinct model input), then
        generation rows grouped by generation kwargs.

        With ``world_size`` > 1 each segment is padded with repeats of its last batch to a multiple of
        ``world_size``, so that ``DistributedSampler`` (index ``i`` to rank ``i % world_size``) gives all
        ranks the same kind of batch at every step (FSDP collectives, ``synced_gpus``); repeats merge away.
        """
        rows: dict[tuple, list[tuple[int, tuple]]] = defaultdict(list)
        generate: dict[str, list[tuple[int, tuple]]] = defaultdict(list)
        for index, item in enumerate(self.items):
            if item[0] == SCORE:
                rows[item[1]].append((index, item[2]))
            else:
                generate[item[2]].append((index, item[1]))
        out: list[dict] = []

        def extend(segment: list[dict]) -> None:
            if segment and world_size > 1:
                segment = segment + [segment[-1]] * (-len(segment) % world_size)
            out.extend(segment)

        score_rows = sorted(rows.items(), key=lambda row: (-len(row[0]), row[0]))
        extend([_score_batch(chunk, pad_token_id)
                for chunk in _chunks(score_rows, batch_size, max_batch_tokens, lambda row: len(row[0]))])
        for spec_key in sorted(generate):
            spec = json.loads(spec_key)
            entries = sorted(generate[spec_key], key=lambda entry: (-len(entry[1]), entry[1], entry[0]))
            extend([_generate_batch(chunk, spec, pad_token_id)
                    for chunk in _chunks(entries, batch_size, max_batch_tokens,
                                         lambda entry: len(entry[1]) + spec["max_gen_toks"])])
        return out

    def responses(self, results: Mapping[int, Any]) -> list[Any]:
        """Per request, the response lm-eval expects, from the items' results."""
        missing = [index for index in range(len(self.items)) if index not in results]
        if missing:
            raise RuntimeError(
                f"{len(missing)} of {len(self.items)} work items have no result (e.g. item {missing[0]}).")
        out = []
        for request in self.requests:
            kind = request.instance.request_type
            if kind == LOGLIKELIHOOD:
                logprob, greedy = results[request.items[0]]
                out.append((float(logprob), bool(greedy)))
            elif kind == ROLLING:
                out.append(float(sum(results[index][0] for index in request.items)))
            else:
                out.append(results[request.items[0]])
        return out

    def counts(self) -> dict[str, int]:
        """How many requests (per type), score items, score rows and generate items the plan holds."""
        kinds = Counter(request.instance.request_type for request in self.requests)
        score = sum(1 for item in self.items if item[0] == SCORE)
        return {"requests": len(self.requests), **{f"requests_{k}": v for k, v in sorted(kinds.items())},
                "score_items": score, "score_rows": len({item[1] for item in self.items if item[0] == SCORE}),
                "generate_items": len(self.items) - score}


def _chunks(entries: list, batch_size: int, max_batch_tokens: int | None, length) -> list[list]:
    chunks: list[list] = []
    width = 0  # padded length of the last chunk
    for entry in entries:
        width = max(width, length(entry))
        if not chunks or len(chunks[-1]) >= batch_size or (
                max_batch_tokens is not None and width * (len(chunks[-1]) + 1) > max_batch_tokens):
            chunks.append([])
            width = length(entry)
        chunks[-1].append(entry)
    return chunks


def _right_padded(sequences: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    return pad_sequence([torch.tensor(tokens, dtype=torch.long) for tokens in sequences], batch_first=True,
                        padding_value=pad)


def _score_batch(rows: list[tuple[tuple, list[tuple[int, tuple]]]], pad_token_id: int) -> dict[str, Any]:
    targets = [(row, index, continuation) for row, (_, entries) in enumerate(rows) for index, continuation in entries]
    return {
        "kind": SCORE,
        "input_ids": _right_padded([tokens for tokens, _ in rows], pad_token_id),  # right padding, as HFLM
        "lengths": torch.tensor([len(tokens) for tokens, _ in rows], dtype=torch.long),
        "target_items": torch.tensor([index for _, index, _ in targets], dtype=torch.long),
        "target_rows": torch.tensor([row for row, _, _ in targets], dtype=torch.long),
        "target_tokens": _right_padded([continuation for _, _, continuation in targets], -1),
        "target_lengths": torch.tensor([len(continuation) for _, _, continuation in targets], dtype=torch.long),
    }


def _generate_batch(entries: list[tuple[int, tuple]], spec: dict[str, Any], pad_token_id: int) -> dict[str, Any]:
    # Left padding: the right-padded reversed rows, reversed back.
    input_ids = _right_padded([tokens[::-1] for _, tokens in entries], pad_token_id).flip(1)
    attention_mask = _right_padded([[1] * len(tokens) for _, tokens in entries], 0).flip(1)
    return {
        "kind": GENERATE,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "items": torch.tensor([index for index, _ in entries], dtype=torch.long),
        "until": list(spec["until"]),
        "max_gen_toks": int(spec["max_gen_toks"]),
        "generate_kwargs": dict(spec["generate_kwargs"]),
    }
