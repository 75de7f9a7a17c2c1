"""The int8 weight type: exact uint8 x weight products on this CPU, whatever its instruction set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tk.errors import UsageError
from tk.export.onnx.dynamic_int8 import int8_onnx_from_onnx, weight_type
from tk.formats.products import saturating_int8_products

K = 64  # products summed per output: 32 pairs, each pair can overflow int16 at full range


def _matmul_integer(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """onnxruntime's ``MatMulInteger`` of uint8 ``a`` by the weight ``b`` (int32 out)."""
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, list(a.shape))],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [a.shape[0], b.shape[1]])],
        [numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"a": a})[0]


def _full_range_error(weights: str) -> int:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (8, K), dtype=np.uint8)
    if weights == "uint8":
        b = rng.integers(0, 256, (K, 16), dtype=np.uint8)
    else:
        b = rng.integers(-128, 128, (K, 16), dtype=np.int8)
    exact = a.astype(np.int64) @ b.astype(np.int64)
    return int(np.abs(_matmul_integer(a, b) - exact).max())


def test_the_chosen_weight_type_multiplies_full_range_activations_exactly() -> None:
    assert _full_range_error(weight_type()) == 0


def test_int8_weights_saturate_exactly_where_the_cpu_is_said_to_saturate() -> None:
    # vpmaddubsw (x86 without VNNI/AMX) clamps each pair sum to int16: errors in the tens of thousands
    error = _full_range_error("int8")
    assert (error > 1000) == saturating_int8_products(), error


def test_saturation_is_decided_by_the_cpu_flags() -> None:
    assert saturating_int8_products("x86_64", frozenset({"avx2", "fma"}))
    assert not saturating_int8_products("x86_64", frozenset({"avx2", "avx_vnni"}))
    assert not saturating_int8_products("x86_64", frozenset({"avx512f", "avx512_vnni"}))
    assert not saturating_int8_products("aarch64", frozenset({"asimd"}))
    assert weight_type("int8") == "int8"
    with pytest.raises(UsageError, match="int8 weights: expected one of int8, uint8"):
        weight_type("int4")


def _linear_graph(path: Path, width: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    w = rng.uniform(-1, 1, (width, width)).astype(np.float32)  # uniform, as nn.Linear initializes
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    x = rng.standard_normal((16, width)).astype(np.float32)
    return x, x @ w


def _sqnr_db(reference: np.ndarray, value: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference**2) / np.sum((reference - value) ** 2)))


def test_dynamic_int8_keeps_its_signal_on_this_cpu(tmp_path: Path) -> None:
    # one dynamically quantized product: about 41 dB when exact; with int8 weights on a CPU whose
    # products saturate (AVX2 without VNNI), about 20 dB
    x, reference = _linear_graph(tmp_path / "fp32.onnx")
    int8_onnx_from_onnx(tmp_path / "fp32.onnx", tmp_path / "int8.onnx")
    ops = [n.op_type for n in onnx.load(str(tmp_path / "int8.onnx")).graph.node]
    assert "MatMulInteger" in ops
    session = ort.InferenceSession(str(tmp_path / "int8.onnx"), providers=["CPUExecutionProvider"])
    assert _sqnr_db(reference, session.run(None, {"x": x})[0]) >= 35
