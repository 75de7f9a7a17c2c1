"""KServe v2 request parsing and replies: JSON and binary tensors, and one 400 message per bad request."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tk.errors import InputError
from tk.serve.protocol import encode_infer_response, model_metadata, parse_infer_request
from tk.spec import Dim, TensorSpec

INPUTS = [
    TensorSpec("input_ids", "int64", ("batch", "seq"), kind="ids", low=0, high=1000),
    TensorSpec("attention_mask", "int64", ("batch", "seq"), kind="mask", low=0, high=2),
]
OUTPUTS = [TensorSpec("logits", "float32", ("batch", 2))]
DIMS = {"batch": Dim("batch", 1, 8, 64), "seq": Dim("seq", 1, 16, 64)}


def tensor(name, array, datatype="INT64", binary=False):
    entry = {"name": name, "shape": list(array.shape), "datatype": datatype}
    if binary:
        entry["parameters"] = {"binary_data_size": array.nbytes}
    else:
        entry["data"] = array.reshape(-1).tolist()
    return entry


def body_of(inputs, blobs=(), **extra):
    header = json.dumps({"inputs": inputs, **extra}).encode()
    headers = {"Inference-Header-Content-Length": str(len(header))} if blobs else {}
    return header + b"".join(blobs), headers


def parse(body, headers=None, max_samples=8):
    return parse_infer_request(body, headers or {}, INPUTS, OUTPUTS, DIMS, max_samples)


def sample(batch=2, seq=5, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, (batch, seq)).astype(np.int64)
    mask = np.ones((batch, seq), np.int64)
    mask[0, -1] = 0
    return ids, mask


def test_json_and_binary_requests_give_the_same_arrays():
    ids, mask = sample()
    json_body, _ = body_of([tensor("input_ids", ids), tensor("attention_mask", mask)], id="r1")
    from_json = parse(json_body)
    blobs = (ids.tobytes(), mask.tobytes())
    bin_body, headers = body_of(
        [tensor("input_ids", ids, binary=True), tensor("attention_mask", mask, binary=True)], blobs
    )
    from_binary = parse(bin_body, headers)
    for request in (from_json, from_binary):
        assert request.samples == 2
        assert request.outputs == ["logits"]
        np.testing.assert_array_equal(request.feeds["input_ids"], ids)
        np.testing.assert_array_equal(request.feeds["attention_mask"], mask)
        assert request.feeds["input_ids"].dtype == np.int64
    assert from_json.id == "r1"


def test_binary_outputs_round_trip():
    ids, mask = sample(batch=3)
    body, _ = body_of(
        [tensor("input_ids", ids), tensor("attention_mask", mask)],
        outputs=[{"name": "logits", "parameters": {"binary_data": True}}],
    )
    request = parse(body)
    logits = np.arange(6, dtype=np.float32).reshape(3, 2) / 7
    reply, headers = encode_infer_response("m", request, {"logits": logits})
    length = int(headers["inference-header-content-length"])
    header = json.loads(reply[:length])
    assert header["outputs"][0]["shape"] == [3, 2] and header["outputs"][0]["datatype"] == "FP32"
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 24
    np.testing.assert_array_equal(np.frombuffer(reply[length:], np.float32).reshape(3, 2), logits)
    json_request = parse(body_of([tensor("input_ids", ids), tensor("attention_mask", mask)])[0])
    reply, headers = encode_infer_response("m", json_request, {"logits": logits})
    assert headers["content-type"] == "application/json"
    assert json.loads(reply)["outputs"][0]["data"] == logits.reshape(-1).tolist()


def test_metadata_marks_dynamic_dims():
    from tk.manifest import Manifest
    from tk.spec import Signature

    manifest = Manifest(model={"name": "t"}, signature=Signature(INPUTS, OUTPUTS, DIMS), precision="fp32", device="cpu")
    meta = model_metadata(manifest, "t", "tk_onnx")
    assert meta["inputs"] == [
        {"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]},
        {"name": "attention_mask", "datatype": "INT64", "shape": [-1, -1]},
    ]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 2]}]


def _bad_requests():
    ids, mask = sample()
    good = [tensor("input_ids", ids), tensor("attention_mask", mask)]
    wide = sample(batch=9)
    out_of_range = ids.copy()
    out_of_range[1, 2] = 1000
    empty_mask = mask.copy()
    empty_mask[1] = 0
    return {
        "malformed JSON": ((b'{"inputs": [', {}), "malformed JSON"),
        "not an object": ((b"[1, 2]", {}), 'expected a JSON object with an "inputs" list'),
        "unknown input": (body_of([*good, tensor("token_type_ids", ids)]), "unknown input 'token_type_ids'"),
        "missing input": (body_of(good[:1]), "missing ['attention_mask']"),
        "twice": (body_of([good[0], good[0], good[1]]), "given twice"),
        "wrong datatype": (
            body_of([tensor("input_ids", ids.astype(np.float32), "FP32"), good[1]]),
            "expected datatype INT64, got 'FP32'",
        ),
        "floats as ints": (
            body_of([{**good[0], "data": [0.5] * ids.size}, good[1]]),
            "expected integers for datatype INT64",
        ),
        "shape and data disagree": (body_of([{**good[0], "shape": [2, 6]}, good[1]]), "holds 12 values"),
        "rank": (body_of([{**good[0], "shape": [10]}, good[1]]), "expected rank 2"),
        "seq mismatch": (body_of([good[0], tensor("attention_mask", np.ones((2, 4), np.int64))]), "disagree"),
        "token id": (body_of([tensor("input_ids", out_of_range), good[1]]), "token id 1000 is outside"),
        "empty mask row": (body_of([good[0], tensor("attention_mask", empty_mask)]), "all 0"),
        "too many samples": (
            body_of([tensor("input_ids", wide[0]), tensor("attention_mask", wide[1])]),
            "at most 8 samples a request, got 9",
        ),
        "seq too long": (
            body_of(
                [tensor("input_ids", np.zeros((1, 65), np.int64)), tensor("attention_mask", np.ones((1, 65), np.int64))]
            ),
            "must be in [1, 64]",
        ),
        "short binary": (
            (body_of([tensor("input_ids", ids, binary=True), good[1]], (ids.tobytes()[:-8],))),
            "expected 80 bytes of binary data",
        ),
        "unknown output": (body_of(good, outputs=[{"name": "probs"}]), "unknown output 'probs'"),
        "bad header length": ((b"{}", {"Inference-Header-Content-Length": "x"}), "expected an integer"),
    }


BAD = _bad_requests()


@pytest.mark.parametrize("case", sorted(BAD))
def test_every_bad_request_gets_one_clear_message(case):
    (body, headers), fragment = BAD[case]
    with pytest.raises(InputError) as info:
        parse(body, headers)
    message = str(info.value)
    assert fragment in message, message
    assert "\n" not in message


FLOAT_INPUTS = [TensorSpec("x", "float32", ("batch", 4))]
HALF_INPUTS = [TensorSpec("x", "float16", ("batch", 4))]


def parse_float(body, headers=None, specs=FLOAT_INPUTS):
    return parse_infer_request(body, headers or {}, specs, OUTPUTS, DIMS, 8)


@pytest.mark.parametrize(
    "value, fragment",
    [
        (float("nan"), "expected finite FP32 values, got nan"),
        (float("inf"), "expected finite FP32 values, got inf"),
        (1e39, "value 1e+39 is outside the range of FP32"),
        (-1e39, "value -1e+39 is outside the range of FP32"),
    ],
)
def test_non_finite_and_out_of_range_floats_are_400s(value, fragment):
    data = [0.5, 1.0, value, 2.0]
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": data}]}).encode()
    with pytest.raises(InputError, match=re.escape(fragment)):
        parse_float(body)
    with np.errstate(over="ignore"):
        blob = np.array([data], np.float64).astype(np.float32)  # the binary form: 1e39 is already inf here
    if np.isfinite(blob).all():
        return
    body, headers = body_of([tensor("x", blob, "FP32", binary=True)], (blob.tobytes(),))
    with pytest.raises(InputError, match="expected finite FP32 values"):
        parse_float(body, headers)


def test_float16_range_and_good_floats():
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP16", "data": [1, 2, 3, 1e5]}]})
    with pytest.raises(InputError, match=r"value 100000\.0 is outside the range of FP16"):
        parse_float(body.encode(), specs=HALF_INPUTS)
    ok = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, -2.5, 3e38, 0]}]})
    assert parse_float(ok.encode()).feeds["x"].dtype == np.float32


@pytest.mark.parametrize(
    "value, fragment",
    [
        (2**63, "value 9223372036854775808 is outside the range of INT64"),
        (2**64, "value 18446744073709551616 is outside the range of INT64"),  # past uint64: numpy objects
        (-(2**63) - 1, "value -9223372036854775809 is outside the range of INT64"),
    ],
)
def test_integers_outside_int64_are_400s_not_wrapped(value, fragment):
    ids, mask = sample(batch=1, seq=2)
    entry = tensor("input_ids", ids)
    entry["data"] = [value, value]
    with pytest.raises(InputError, match=re.escape(fragment)):
        parse(json.dumps({"inputs": [entry, tensor("attention_mask", mask)]}).encode())


def test_gzip_and_deflate_bodies_are_decoded_within_the_limit_and_anything_else_is_refused():
    import gzip
    import zlib

    from tk.serve.protocol import RequestTooLarge, UnsupportedEncoding, decoded_body

    ids, mask = sample()
    body, headers = body_of(
        [tensor("input_ids", ids, binary=True), tensor("attention_mask", mask, binary=True)],
        (ids.tobytes(), mask.tobytes()),
    )
    plain = parse(body, headers)
    for name, packed in (("gzip", gzip.compress(body)), ("Deflate", zlib.compress(body))):  # tritonclient's two
        request = parse(decoded_body(packed, {"Content-Encoding": name}, 10_000), headers)
        np.testing.assert_array_equal(request.feeds["input_ids"], plain.feeds["input_ids"])
    assert decoded_body(body, {"content-encoding": "identity"}, 10_000) == body == decoded_body(body, {}, 10)
    bomb = gzip.compress(b"0" * 1_000_000)  # ~1 KB that inflates to 1 MB
    with pytest.raises(RequestTooLarge, match=r"more than 10000 \(decompressed\) bytes is over this server's limit"):
        decoded_body(bomb, {"Content-Encoding": "gzip"}, 10_000)
    with pytest.raises(InputError, match="Content-Encoding gzip: the body is not gzip data"):
        decoded_body(b"not gzip at all", {"Content-Encoding": "gzip"}, 10_000)
    with pytest.raises(InputError, match="Content-Encoding gzip: the body ends before its compressed stream does"):
        decoded_body(gzip.compress(body)[:-12], {"Content-Encoding": "gzip"}, 10_000)
    with pytest.raises(
        UnsupportedEncoding, match="header Content-Encoding: expected gzip, deflate or identity, got 'br'"
    ):
        decoded_body(body, {"Content-Encoding": "br"}, 10_000)


def test_deep_nesting_huge_numbers_and_many_dims_are_400s():
    deep = b'{"inputs": [{"name": "input_ids", "data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"
    with pytest.raises(InputError, match="nested too deeply"):
        parse(deep)
    with pytest.raises(InputError, match="malformed JSON"):
        parse(b'{"inputs": [], "id": ' + b"9" * 5000 + b"}")  # past Python's int digit limit
    ids, mask = sample(batch=1, seq=1)
    shaped = tensor("input_ids", ids, binary=True)
    shaped["shape"] = [1] * 65
    body, headers = body_of([shaped, tensor("attention_mask", mask, binary=True)], (ids.tobytes(), mask.tobytes()))
    with pytest.raises(InputError, match=r"expected rank 2 \(a \"shape\" of 2 sizes\), got 65"):
        parse(body, headers)
    nested = tensor("input_ids", ids)
    nested["data"] = json.loads("[" * 200 + "1" + "]" * 200)
    with pytest.raises(InputError):
        parse(json.dumps({"inputs": [nested, tensor("attention_mask", mask)]}).encode())


def test_default_request_limit_fits_the_largest_valid_request():
    from tk.serve.protocol import JSON_VALUE_WIDTH, declared_length, max_request_bytes

    limit = max_request_bytes(INPUTS, DIMS, 64)
    ids = np.full((64, 64), 999, np.int64)
    mask = np.ones((64, 64), np.int64)
    largest_json, _ = body_of([tensor("input_ids", ids), tensor("attention_mask", mask)])
    largest_binary, _ = body_of(
        [tensor("input_ids", ids, binary=True), tensor("attention_mask", mask, binary=True)],
        (ids.tobytes(), mask.tobytes()),
    )
    assert len(largest_json) < limit and len(largest_binary) < limit
    assert limit == 2 * 64 * 64 * JSON_VALUE_WIDTH + (64 << 10)  # 2 inputs x batch 64 x seq 64 values
    assert max_request_bytes(INPUTS, DIMS, 8) < limit  # a smaller --max-batch lowers it
    assert declared_length({"Content-Length": "12"}) == 12 and declared_length({}) is None
    with pytest.raises(InputError, match="Content-Length: expected a byte count"):
        declared_length({"content-length": "-5"})


def test_replies_are_strict_json():
    from tk.serve.protocol import InferRequest, NonFiniteOutputError, error_body

    request = InferRequest({}, 1, ["logits"], {"logits": False})
    with pytest.raises(NonFiniteOutputError, match="output logits holds NaN or infinite values"):
        encode_infer_response("m", request, {"logits": np.array([[np.nan, 1.0]], np.float32)})
    binary = InferRequest({}, 1, ["logits"], {"logits": True})
    body, headers = encode_infer_response("m", binary, {"logits": np.array([[np.nan, 1.0]], np.float32)})
    json.loads(body[: int(headers["inference-header-content-length"])], parse_constant=_no_constants)
    json.loads(error_body("x"), parse_constant=_no_constants)


def _no_constants(name):
    raise AssertionError(f"bare {name} in a reply")
