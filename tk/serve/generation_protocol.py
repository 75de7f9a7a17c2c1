"""The requests and replies of ``tk serve`` on a decoder: Triton's generate extension and OpenAI's completions.

Triton's generate extension (``POST /v2/models/NAME/generate``, and ``generate_stream`` as server-sent
events) takes a JSON object whose fields are the model's inputs, here ``text_input`` (with the
artifact's tokenizer) or ``input_ids``, and request parameters either beside them (as TensorRT-LLM's
ensemble takes ``max_tokens``) or under ``parameters`` (as the vLLM backend does). Its reply carries
``text_output`` (the new text only; with a tokenizer), ``output_ids`` and ``finish_reason``.

OpenAI's ``POST /v1/completions`` takes ``prompt`` (a text, token ids, or a list of either: one choice
each), ``max_tokens`` (16 when absent), ``temperature`` (1 when absent, as OpenAI), ``top_p``, ``seed``,
``stop`` and ``stream``, plus ``top_k`` as vLLM accepts it; every choice also carries ``token_ids`` (as
vLLM's ``return_token_ids``), the only output of a model without a tokenizer. Options tk does not
implement (``n`` > 1, ``echo``, ``logprobs``, penalties, ``logit_bias``, ``best_of`` > 1, ``suffix``)
are refused with a 400, never ignored.

Everything a client can get wrong is one ``InputError`` line, answered 400 before the request reaches
the engine: wrong types, unknown fields, a prompt or output longer than the cache allows.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tk.errors import InputError
from tk.runtime.generation import Sampling

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_LENGTH = 256  # characters in one stop string


@dataclass
class GenerationRequest:
    """One request, checked: its prompts as token ids and how to generate from them."""

    prompts: list[list[int]]
    max_new_tokens: int
    sampling: Sampling
    stop: list[str] = field(default_factory=list)  # stop strings (needs the tokenizer)
    stop_ids: list[int] = field(default_factory=list)  # stop tokens besides the model's end-of-sequence
    stream: bool = False
    include_usage: bool = False  # OpenAI's stream_options.include_usage


@dataclass(frozen=True)
class Limits:
    """What the served artifact allows: its vocabulary, cache slots, largest output and prompts per request."""

    vocab_size: int
    slots: int
    max_new_tokens: int
    max_prompts: int


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InputError(message)


def _body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InputError(f"expected a JSON object in the request body, found malformed JSON ({exc})") from None
    _require(isinstance(data, dict), f"expected a JSON object in the request body, found {type(data).__name__}")
    return data


def _integer(data: Mapping[str, Any], key: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = data.get(key, default)
    if value is None:
        return None
    _require(isinstance(value, int) and not isinstance(value, bool), f"{key}: expected an integer, found {value!r:.40}")
    _require(value >= low and (high is None or value <= high),
             f"{key}: expected an integer in [{low}, {high if high is not None else 'inf'}], found {value}")  # fmt: skip
    return int(value)


def _number(data: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = data.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    _require(ok and low <= value <= high, f"{key}: expected a number in [{low:g}, {high:g}], found {value!r:.40}")
    return float(value)


def _token_ids(value: Any, what: str, vocab_size: int) -> list[int]:
    ok = isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    _require(ok, f"{what}: expected a list of token ids (integers), found {value!r:.60}")
    bad = [t for t in value if not 0 <= t < vocab_size]
    _require(not bad, f"{what}: expected token ids in [0, {vocab_size}), found {bad[:1]}")
    return list(value)


def _stop_strings(value: Any) -> list[str]:
    if value is None or value == "":
        return []
    stops = [value] if isinstance(value, str) else value
    ok = isinstance(stops, list) and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH for s in stops)
    _require(ok and len(stops) <= MAX_STOP_STRINGS,
             f"stop: expected a string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
             f"{MAX_STOP_LENGTH} characters, found {value!r:.60}")  # fmt: skip
    return list(stops)


def _sampling(data: Mapping[str, Any]) -> Sampling:
    """Temperature 1 and a fresh seed when absent (what OpenAI and Triton's vLLM backend do)."""
    seed = _integer(data, "seed", None, 0, 2**63 - 1)
    return Sampling(
        temperature=_number(data, "temperature", 1.0, 0.0, 2.0),
        top_k=_integer(data, "top_k", 0, 0) or 0,
        top_p=_number(data, "top_p", 1.0, 1e-6, 1.0),
        seed=seed if seed is not None else int.from_bytes(os.urandom(7), "big"),
    )


def _check_lengths(request: GenerationRequest, limits: Limits) -> GenerationRequest:
    _require(0 < len(request.prompts) <= limits.max_prompts,
             f"prompt: expected 1 to {limits.max_prompts} prompts, found {len(request.prompts)}")  # fmt: skip
    for index, prompt in enumerate(request.prompts):
        _require(len(prompt) > 0, f"prompt {index}: expected at least one token, found an empty prompt")
        total = len(prompt) + request.max_new_tokens
        _require(total <= limits.slots,
                 f"this model's context is {limits.slots} tokens; expected prompt plus max_tokens within it, found "
                 f"{total} ({len(prompt)} in the prompt, {request.max_new_tokens} to generate)")  # fmt: skip
    return request


def parse_triton_generate(body: bytes, limits: Limits, tokenizer: Any, stream: bool) -> GenerationRequest:
    """A Triton generate (or generate_stream) request's prompt and parameters."""
    data = _body(body)
    parameters = data.pop("parameters", {}) or {}
    _require(isinstance(parameters, dict), f"parameters: expected a JSON object, found {parameters!r:.40}")
    known = {"text_input", "input_ids", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_words",
             "stop_ids", "stream", "bad_words"}  # fmt: skip
    merged = {**data, **parameters}
    unknown = sorted(set(merged) - known)
    if unknown:
        raise InputError(f"expected fields among {', '.join(sorted(known))}, found {unknown[0]!r:.40}")
    _require(not merged.get("bad_words"), "bad_words: not supported by tk serve; expected it empty or absent")
    _require(("text_input" in merged) != ("input_ids" in merged),
             "expected exactly one of text_input (a text) and input_ids (token ids)")  # fmt: skip
    prompt = _prompt_ids(merged.get("text_input", merged.get("input_ids")), tokenizer, limits, "text_input"
                         if "text_input" in merged else "input_ids")  # fmt: skip
    max_new = _integer(merged, "max_tokens", min(16, limits.max_new_tokens), 1, limits.max_new_tokens)
    stop = _stop_strings(merged.get("stop", merged.get("stop_words")))
    _require(not stop or tokenizer is not None, "stop: stop strings need the model's tokenizer; give stop_ids")
    stop_ids = _token_ids(merged.get("stop_ids", []), "stop_ids", limits.vocab_size)
    request = GenerationRequest([prompt], int(max_new or 1), _sampling(merged), stop, stop_ids, stream)
    return _check_lengths(request, limits)


def _prompt_ids(value: Any, tokenizer: Any, limits: Limits, what: str) -> list[int]:
    if isinstance(value, str):
        _require(tokenizer is not None, f"{what}: a text prompt needs the model's tokenizer, which this model has "
                 "none of; expected token ids")  # fmt: skip
        ids = list(tokenizer.encode(value))  # the body's size bounds the text (--max-request-bytes)
        return _token_ids(ids, what, limits.vocab_size)
    return _token_ids(value, what, limits.vocab_size)


OPENAI_REFUSED = {
    "n": 1, "best_of": 1, "echo": False, "logprobs": None, "presence_penalty": 0, "frequency_penalty": 0,
    "logit_bias": None, "suffix": None,
}  # fmt: skip
OPENAI_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                "stream_options", "user", *OPENAI_REFUSED}  # fmt: skip


def parse_completion(body: bytes, limits: Limits, tokenizer: Any) -> tuple[str | None, GenerationRequest]:
    """An OpenAI completions request: the model it names (None when it names none) and what to generate."""
    data = _body(body)
    unknown = sorted(set(data) - OPENAI_KNOWN)
    if unknown:
        raise InputError(f"expected OpenAI completion fields, found {unknown[0]!r:.40}, which tk serve does not take")
    for key, allowed in OPENAI_REFUSED.items():
        value = data.get(key)
        _require(value is None or value == allowed or (key == "logit_bias" and value == {}),
                 f"{key}: not supported by tk serve; expected {json.dumps(allowed)} or absent, found {value!r:.40}")  # fmt: skip
    model = data.get("model")
    _require(model is None or isinstance(model, str), f"model: expected a string, found {model!r:.40}")
    _require("prompt" in data, "prompt: expected a text, token ids, or a list of either; found none")
    raw = data["prompt"]
    many = isinstance(raw, list) and bool(raw) and all(isinstance(p, str | list) for p in raw)
    prompts = [_prompt_ids(p, tokenizer, limits, f"prompt {i}") for i, p in enumerate(raw if many else [raw])]
    options = data.get("stream_options") or {}
    _require(isinstance(options, dict) and set(options) <= {"include_usage"},
             f"stream_options: expected {{\"include_usage\": bool}}, found {options!r:.40}")  # fmt: skip
    stream = data.get("stream") or False
    _require(isinstance(stream, bool), f"stream: expected true or false, found {stream!r:.20}")
    stop = _stop_strings(data.get("stop"))
    _require(not stop or tokenizer is not None, "stop: stop strings need the model's tokenizer, which it has none of")
    max_new = _integer(data, "max_tokens", min(16, limits.max_new_tokens), 1, limits.max_new_tokens)
    request = GenerationRequest(prompts, int(max_new or 1), _sampling(data), stop, [], stream,
                                bool(options.get("include_usage")))  # fmt: skip
    return model, _check_lengths(request, limits)


def sse(event: Any) -> bytes:
    """One server-sent event carrying ``event`` as JSON (or ``[DONE]``, as OpenAI ends a stream)."""
    text = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"), allow_nan=False)
    return f"data: {text}\n\n".encode()


def openai_error(message: str, code: int) -> bytes:
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}.get(
        code, "server_error"
    )
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class TextStream:
    """A row's text as its tokens come: each ``push`` gives the new text that is safe to send (none while the
    last token ends inside a character, or the text ends with what may begin a stop string); ``finish``
    gives the rest. ``stopped`` once a stop string appears: the text is cut before it."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.tokens: list[int] = []
        self.sent = 0  # characters sent
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        if self.tokenizer is None or self.stopped:
            return ""
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        for stop in self.stops:
            at = self.text.find(stop)
            if at >= 0:
                self.text, self.stopped = self.text[:at], True
        if self.stopped:
            return self._send(len(self.text))
        if self.text.endswith("\ufffd"):
            return ""
        hold = max((len(s) - 1 for s in self.stops), default=0)
        return self._send(len(self.text) - hold)

    def finish(self) -> str:
        return self._send(len(self.text)) if self.tokenizer is not None else ""

    def _send(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : upto], upto
        return piece
