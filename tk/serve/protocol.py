"""The KServe v2 inference protocol over HTTP (what Triton and ``tritonclient.http`` speak).

A request is JSON (``{"inputs": [{"name", "shape", "datatype", "data"}], "outputs": [...]}``),
optionally followed by raw tensor bytes: with the binary tensor extension the header
``Inference-Header-Content-Length`` gives the JSON's length, and each input whose
``parameters.binary_data_size`` is set takes that many bytes of the rest, in order.
``tritonclient.http`` sends binary data by default, so both forms are read here; outputs are sent
as binary when the request asks for it (``parameters.binary_data`` per output, or
``binary_data_output`` for all).

Parsing checks everything a request can get wrong (malformed JSON, unknown or missing inputs,
datatype, shape against the data, sizes, token ids and masks through
``tk.runtime.inputs.check_arrays``) and raises ``InputError`` with one line, so that a bad
request is answered 400 and never reaches an engine. This module does not import Ray.
"""

from __future__ import annotations

import functools
import json
import math
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import numpy as np

from tk.errors import InputError, TkError, UsageError, first_line
from tk.manifest import Manifest
from tk.runtime.inputs import check_arrays, sample_dim
from tk.spec import Dim, TensorSpec, numpy_dtype

HEADER_LENGTH = "inference-header-content-length"
P = ParamSpec("P")
R = TypeVar("R")

# tk dtype -> KServe v2 datatype
DATATYPES: dict[str, str] = {
    "float32": "FP32",
    "float16": "FP16",
    "bfloat16": "BF16",
    "float64": "FP64",
    "int64": "INT64",
    "int32": "INT32",
    "bool": "BOOL",
}


NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def default_model_name(manifest: Manifest) -> str:
    """The name a model is served (and deployed) under when the user gives none: the manifest's
    model name made safe for URLs and directories. For ``hf:/abs/dir`` that is the directory's own
    name (``dir``); ``pkg.module:build`` becomes ``pkg.module-build``."""
    raw = str(manifest.model.get("name") or "model")
    if raw.startswith("hf:"):
        raw = Path(raw[3:].rstrip("/")).name
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", raw).lstrip(".-")[:128]
    return safe or "model"


def check_model_name(name: str) -> str:
    """``name`` (from ``--name``) when it is safe in a URL and as a directory; else one line."""
    if not NAME_PATTERN.fullmatch(name):
        raise UsageError(
            f"--name {name!r}: expected 1 to 128 letters, digits, '_', '.' or '-', not starting with '.' or '-'"
        )
    return name


FLOAT_DATATYPES = ("FP32", "FP16", "BF16", "FP64")


def datatype_of(array: np.ndarray) -> str:
    """The KServe v2 datatype of a NumPy array (bfloat16 through ml_dtypes)."""
    name = array.dtype.name
    if name not in DATATYPES:
        raise InputError(f"cannot send dtype {name} over KServe v2: expected one of {', '.join(DATATYPES)}")
    return DATATYPES[name]


@dataclass
class InferRequest:
    """One parsed, checked request: its feeds, sample count and what the reply must hold."""

    feeds: dict[str, np.ndarray]
    samples: int
    outputs: list[str]  # the outputs to return, in order
    binary: dict[str, bool]  # output name -> send it as binary data
    id: str | None = None
    enqueued: float = 0.0  # perf_counter when the request was queued for a batch
    shape_key: tuple[tuple[int, ...], ...] = field(default=())  # non-batch shapes: requests that can share a call
    phase_ns: dict[str, int] = field(default_factory=dict)  # queue, compute_input, compute_infer (Triton's stats)


JSON_VALUE_WIDTH = 32  # characters per value a JSON request may spend ("-1.2345678901234567e-308, " is 26)
REQUEST_OVERHEAD = 64 << 10  # bytes for the JSON around the values: names, shapes, parameters, id


def max_request_bytes(specs: list[TensorSpec], dims: Mapping[str, Dim], max_samples: int) -> int:
    """The default request size limit: the larger of the JSON and the binary form of a request at
    every dimension's max size (the batch at ``max_samples``), JSON at ``JSON_VALUE_WIDTH``
    characters a value, plus ``REQUEST_OVERHEAD``. No valid request is larger."""
    batch = sample_dim(specs)
    values = binary = 0
    for spec in specs:
        count = 1
        for d in spec.shape:
            if isinstance(d, int):
                count *= d
            elif d == batch:
                count *= max_samples
            else:
                count *= dims[d].max if d in dims else 1
        values += count
        binary += count * numpy_dtype(spec.dtype).itemsize
    return max(values * JSON_VALUE_WIDTH, binary + 1024 * len(specs)) + REQUEST_OVERHEAD


def declared_length(headers: Mapping[str, str]) -> int | None:
    """The request's Content-Length, or None when it has none (chunked); ``InputError`` when it is no size."""
    text = next((v for k, v in headers.items() if k.lower() == "content-length"), None)
    if text is None:
        return None
    if not text.strip().isdigit():
        raise InputError(f"header Content-Length: expected a byte count, got {_short(text)}")
    return int(text)


class RequestTooLarge(TkError):
    """A request body over the server's limit (answered 413)."""


class UnsupportedEncoding(TkError):
    """A request body in a ``Content-Encoding`` the server does not decode (answered 415)."""


# Content-Encoding -> zlib's wbits: what tritonclient's request_compression_algorithm sends (gzip.compress,
# zlib.compress) and Triton's server decodes
ENCODINGS = {"gzip": 16 + 15, "deflate": 15}


def decoded_body(body: bytes, headers: Mapping[str, str], limit: int) -> bytes:
    """``body`` decompressed per its ``Content-Encoding`` (gzip, deflate, identity), never past ``limit``
    bytes (``RequestTooLarge``: a small body may inflate a thousandfold); ``InputError`` for a damaged one,
    and for bytes after the end of its one compressed stream (a second gzip member, trailing data): a
    body is answered whole or refused, never from its first part alone."""
    encoding = next((v for k, v in headers.items() if k.lower() == "content-encoding"), "").strip().lower()
    if encoding in ("", "identity"):
        return body
    wbits = ENCODINGS.get(encoding)
    if wbits is None:
        raise UnsupportedEncoding(
            f"header Content-Encoding: expected gzip, deflate or identity, got {_short(encoding)}"
        )
    inflate = zlib.decompressobj(wbits)
    try:
        out = inflate.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InputError(f"Content-Encoding {encoding}: the body is not {encoding} data ({exc})") from None
    if len(out) > limit or inflate.unconsumed_tail:
        raise too_large(f"more than {limit} (decompressed)", limit)
    if not inflate.eof:
        raise InputError(f"Content-Encoding {encoding}: the body ends before its compressed stream does")
    if inflate.unused_data:
        raise InputError(
            f"Content-Encoding {encoding}: expected one compressed stream, got {len(inflate.unused_data)} bytes "
            "after its end (a second gzip member or trailing data)"
        )
    return out


def too_large(size: int | str, limit: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"request body of {size} bytes is over this server's limit of {limit} bytes "
        "(tk serve --max-request-bytes; the default fits the largest valid request)"
    )


def model_metadata(manifest: Manifest, name: str, platform: str) -> dict[str, Any]:
    """``GET /v2/models/NAME``: inputs and outputs with datatypes and shapes (-1 where dynamic)."""
    sig = manifest.signature

    def tensor(spec: TensorSpec) -> dict[str, Any]:
        shape = [d if isinstance(d, int) else -1 for d in spec.shape]
        return {"name": spec.name, "datatype": DATATYPES[spec.dtype], "shape": shape}

    return {
        "name": name,
        "versions": ["1"],
        "platform": platform,
        "inputs": [tensor(s) for s in sig.inputs],
        "outputs": [tensor(s) for s in sig.outputs],
    }


_MALFORMED = (RecursionError, ValueError, TypeError, OverflowError, KeyError, IndexError, AttributeError)


def _malformed_is_input_error(parse: Callable[P, R]) -> Callable[P, R]:
    """Whatever a request's content makes ``parse`` raise is the request's fault: an ``InputError`` (400), never a 500."""

    @functools.wraps(parse)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return parse(*args, **kwargs)
        except _MALFORMED as exc:
            raise InputError(f"malformed request ({type(exc).__name__}: {first_line(exc)})") from None

    return checked


@_malformed_is_input_error
def parse_infer_request(
    body: bytes,
    headers: Mapping[str, str],
    specs: list[TensorSpec],
    output_specs: list[TensorSpec],
    dims: dict[str, Dim],
    max_samples: int,
) -> InferRequest:
    """Parse and check a ``POST /v2/models/NAME/infer`` body; raise ``InputError`` for a bad one.

    ``max_samples`` bounds the samples of one request (the server's max batch).
    """
    request, json_length = _request_json(body, headers)
    binary = memoryview(body)[json_length:]
    by_name = {s.name: s for s in specs}
    feeds: dict[str, np.ndarray] = {}
    offset = 0
    for item in request["inputs"]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InputError('request: every entry of "inputs" must be an object with a "name"')
        name = item["name"]
        if name not in by_name:
            raise InputError(f"unknown input {_short(name)}: this model takes {[s.name for s in specs]}")
        if name in feeds:
            raise InputError(f"input {name!r} is given twice")
        array, offset = _tensor(item, by_name[name], binary, offset)
        feeds[name] = array
    if offset != len(binary):
        raise InputError(f"request: {len(binary) - offset} bytes of binary data follow the inputs and belong to none")
    batch = sample_dim(specs)
    sizes = check_arrays(feeds, specs, dims=dims, free=(batch,), source=None, exact_dtype=True)
    samples = sizes[batch]
    if samples > max_samples:
        raise InputError(
            f"dimension {batch!r}: this server takes at most {max_samples} samples a request, got {samples}"
        )
    outputs, wants_binary = _requested_outputs(request, output_specs)
    request_id = request.get("id")
    shape_key = tuple(feeds[s.name].shape[1:] for s in specs)
    return InferRequest(
        feeds, samples, outputs, wants_binary, str(request_id) if request_id is not None else None, shape_key=shape_key
    )


def _request_json(body: bytes, headers: Mapping[str, str]) -> tuple[dict[str, Any], int]:
    """The request's JSON object and its length at the start of ``body`` (binary tensor data follows it)."""
    lowered = {k.lower(): v for k, v in headers.items()}
    header_length = lowered.get(HEADER_LENGTH)
    if header_length is not None:
        try:
            json_length = int(header_length)
        except ValueError:
            raise InputError(
                f"header Inference-Header-Content-Length: expected an integer, got {header_length!r}"
            ) from None
        if not 0 < json_length <= len(body):
            raise InputError(
                f"header Inference-Header-Content-Length is {json_length}, expected 1 to the body's {len(body)} bytes"
            )
    else:
        json_length = len(body)
    try:
        request = json.loads(body[:json_length])
    except RecursionError:
        raise InputError("malformed JSON in the request body: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, integers past Python's digit limit
        raise InputError(f"malformed JSON in the request body: {first_line(exc)}") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise InputError('request: expected a JSON object with an "inputs" list')
    return request, json_length


def _tensor(item: dict[str, Any], spec: TensorSpec, binary: memoryview, offset: int) -> tuple[np.ndarray, int]:
    """One input's array from its JSON entry (``data``) or the binary section; the new offset."""
    prefix = f"input {spec.name!r}"
    expected = DATATYPES[spec.dtype]
    if item.get("datatype") != expected:
        raise InputError(f"{prefix}: expected datatype {expected}, got {_short(item.get('datatype'))}")
    shape = item.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InputError(f'{prefix}: expected "shape" as a list of sizes, got {_short(shape)}')
    if len(shape) != len(spec.shape):
        raise InputError(
            f'{prefix}: expected rank {len(spec.shape)} (a "shape" of {len(spec.shape)} sizes), got {len(shape)}'
        )
    dtype = numpy_dtype(spec.dtype)
    parameters = item.get("parameters") or {}
    size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if size is not None:
        return _binary_tensor(binary[offset:], size, prefix, expected, dtype, shape), offset + size
    if "data" not in item:
        raise InputError(f'{prefix}: expected "data" or parameters.binary_data_size')
    return _json_tensor(item["data"], prefix, expected, dtype, shape), offset


def _binary_tensor(
    binary: memoryview, size: Any, prefix: str, expected: str, dtype: np.dtype, shape: list[int]
) -> np.ndarray:
    """An input's array from the first ``size`` bytes of ``binary`` (what is left of the binary section)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not isinstance(size, int) or size != nbytes:
        raise InputError(
            f"{prefix}: binary_data_size is {_short(size)}, expected {nbytes} bytes for shape {shape} of {expected}"
        )
    if size > len(binary):
        raise InputError(f"{prefix}: expected {size} bytes of binary data, the body holds {len(binary)}")
    array = np.frombuffer(binary[:size], dtype=dtype).reshape(shape).copy()
    _require_finite(array, prefix, expected)
    return array


def _json_tensor(data: Any, prefix: str, expected: str, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    """An input's array from its JSON ``data``, checked against its datatype's kind and range."""
    count = math.prod(shape)
    try:
        raw = np.asarray(data)
    except ValueError as exc:
        raise InputError(f'{prefix}: "data" is not a regular array ({exc})') from None
    kinds = {"INT64": "iu", "INT32": "iu", "BOOL": "b"}.get(expected, "iuf")
    if raw.size and raw.dtype.kind == "O" and dtype.kind in "iu":  # numpy keeps integers past uint64 as objects
        info = np.iinfo(dtype)
        flat = raw.reshape(-1).tolist()
        if all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            bad = next(v for v in flat if not info.min <= v <= info.max)
            raise InputError(
                f"{prefix}: value {_short(bad)} is outside the range of {expected} ({info.min} to {info.max})"
            )
    if raw.size and raw.dtype.kind not in kinds:
        what = {"iu": "integers", "b": "true/false values", "iuf": "numbers"}[kinds]
        raise InputError(f"{prefix}: expected {what} for datatype {expected}, got {raw.dtype.kind!r}-kind values")
    if raw.size != count:
        raise InputError(f'{prefix}: shape {shape} holds {count} values, "data" has {raw.size}')
    if raw.size and dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = raw.min(), raw.max()
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise InputError(f"{prefix}: value {bad} is outside the range of {expected} ({info.min} to {info.max})")
    if raw.size and raw.dtype.kind == "f":
        _require_finite(raw, prefix, expected)
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused just below, in one line
            array = raw.astype(dtype).reshape(shape)
    except (OverflowError, ValueError) as exc:
        raise InputError(f"{prefix}: values do not fit {expected} ({exc})") from None
    if raw.size and expected in FLOAT_DATATYPES:
        finite = np.isfinite(_as_float(array)).reshape(-1)
        if not finite.all():  # finite before the cast: 1e39 for FP32, 1e5 for FP16
            raise InputError(f"{prefix}: value {raw.reshape(-1)[~finite][0]} is outside the range of {expected}")
    return array


def _as_float(array: np.ndarray) -> np.ndarray:
    """``array`` in a dtype NumPy's ``isfinite`` takes (bfloat16 through float32)."""
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


def _require_finite(array: np.ndarray, prefix: str, datatype: str) -> None:
    """NaN and infinities are no valid input: the model's answer to them means nothing."""
    if datatype in FLOAT_DATATYPES:
        values = _as_float(array)
        finite = np.isfinite(values)
        if not finite.all():
            raise InputError(
                f"{prefix}: expected finite {datatype} values, got {values.reshape(-1)[~finite.reshape(-1)][0]} "
                f"({int((~finite).sum())} non-finite)"
            )


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (a hostile request's fields can be huge or deep)."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _requested_outputs(request: dict[str, Any], specs: list[TensorSpec]) -> tuple[list[str], dict[str, bool]]:
    names = [s.name for s in specs]
    parameters = request.get("parameters") or {}
    all_binary = bool(parameters.get("binary_data_output", False)) if isinstance(parameters, dict) else False
    wanted = request.get("outputs")
    if wanted is None:
        return names, dict.fromkeys(names, all_binary)
    if not isinstance(wanted, list):
        raise InputError('request: "outputs" must be a list of {"name": ...} objects')
    outputs: list[str] = []
    binary: dict[str, bool] = {}
    for item in wanted:
        name = item.get("name") if isinstance(item, dict) else None
        if name not in names:
            raise InputError(f"unknown output {_short(name)}: this model returns {names}")
        params = item.get("parameters") or {}
        outputs.append(name)
        binary[name] = bool(params.get("binary_data", all_binary)) if isinstance(params, dict) else all_binary
    return outputs, binary


def encode_infer_response(
    model: str, request: InferRequest, outputs: Mapping[str, np.ndarray]
) -> tuple[bytes, dict[str, str]]:
    """The reply body and its headers: JSON, followed by raw bytes for outputs asked as binary."""
    entries = []
    chunks: list[bytes] = []
    for name in request.outputs:
        array = np.ascontiguousarray(outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": datatype_of(array), "shape": list(array.shape)}
        if request.binary.get(name):
            raw = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = (
                array.astype(np.float32).reshape(-1).tolist()
                if array.dtype.name == "bfloat16"
                else (array.reshape(-1).tolist())
            )
        entries.append(entry)
    reply: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": entries}
    if request.id is not None:
        reply["id"] = request.id
    try:
        header = json.dumps(reply, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        bad = [e["name"] for e in entries if "data" in e and not np.isfinite(np.asarray(e["data"], float)).all()]
        raise NonFiniteOutputError(
            f"output {', '.join(bad)} holds NaN or infinite values, which JSON cannot carry; "
            'ask for it as binary data (parameters {"binary_data": true})'
        ) from None
    if not chunks:
        return header, {"content-type": "application/json"}
    return header + b"".join(chunks), {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }


class NonFiniteOutputError(TkError):
    """An output a request asked for as JSON holds NaN or infinities (the model's doing, not the request's)."""


def error_body(message: str) -> bytes:
    """A KServe v2 error reply: ``{"error": message}``."""
    return json.dumps({"error": message}, allow_nan=False).encode()


def json_body(value: Any) -> bytes:
    """Strict JSON (RFC 8259: no bare NaN or Infinity) for every reply."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
