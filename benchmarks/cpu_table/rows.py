"""The rows of the CPU table: which artifact each loads, which engine runs it, with which options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Row:
    """One line of the table: which artifact, which engine, with which options."""

    label: str  # what the table prints
    precision: str  # fp32 | bf16 | int8: the tolerance the parity is judged by
    artifact: str  # fp32 | bf16 | int8: which export it loads
    engine: str  # a tk engine name, or peer-compile / peer-onnx for the hand-built peers
    options: dict[str, Any] = field(default_factory=dict)


ROWS: dict[str, Row] = {
    "eager": Row("PyTorch eager fp32", "fp32", "fp32", "eager"),
    "compile": Row("torch.compile+freezing fp32", "fp32", "fp32", "compile", {"freezing": True}),
    "compile-plain": Row("torch.compile fp32 (tk bench's baseline)", "fp32", "fp32", "compile"),
    "onnx": Row("onnxruntime fp32", "fp32", "fp32", "onnx"),
    "aoti": Row("AOTInductor fp32", "fp32", "fp32", "aoti"),
    "compile-bf16": Row(
        "torch.compile+freezing bf16 autocast", "bf16", "fp32", "compile", {"precision": "bf16", "freezing": True}
    ),
    "aoti-bf16": Row("AOTInductor bf16", "bf16", "bf16", "aoti"),
    "onnx-int8": Row("onnxruntime dynamic int8", "int8", "int8", "onnx"),
    "peer-compile": Row("peer: torch.compile by hand, static", "fp32", "fp32", "peer-compile"),
    "peer-onnx": Row("peer: onnxruntime session by hand", "fp32", "fp32", "peer-onnx"),
}
FP32_ROWS = ("eager", "compile", "compile-plain", "onnx", "aoti")  # tk's own float32 engines
PEER_ROWS = ("peer-compile", "peer-onnx")
BF16_ROWS = ("compile-bf16", "aoti-bf16")
OVERHEAD_ROWS = ("onnx", "compile", "aoti")  # engines whose bare backend call can be reached
FORMAT_OF = {"onnx": "onnx", "aoti": "aoti", "peer-onnx": "onnx"}  # engines that need an exported format
PRECISIONS = ("fp32", "bf16", "int8")  # the exports, in the order they are made


def formats_by_artifact(keys: list[str]) -> dict[str, tuple[str, ...]]:
    """The formats each artifact precision must hold for ``keys``' rows (``torch`` alone when none)."""
    wanted: dict[str, set[str]] = {}
    for key in keys:
        row = ROWS[key]
        wanted.setdefault(row.artifact, set())
        if row.engine in FORMAT_OF:
            wanted[row.artifact].add(FORMAT_OF[row.engine])
    return {p: tuple(sorted(wanted[p])) or ("torch",) for p in PRECISIONS if p in wanted}


def ordered_rows(keys: list[str]) -> list[str]:
    """``keys`` in the table's order, eager (the reference) first and always present."""
    return ["eager", *(k for k in ROWS if k in keys and k != "eager")]
