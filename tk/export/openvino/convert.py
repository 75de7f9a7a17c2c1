"""``openvino.convert_model`` with its failures as one line: what the openvino writer and the stateful
decoder IR (``tk.export.openvino.stateful``) both call."""

from __future__ import annotations

from typing import Any

from tk.errors import ConversionError, first_line


def converted(source: Any, what: str) -> Any:
    """``openvino.convert_model(source)``; a failure is one ``ConversionError`` line that keeps OpenVINO's cause
    (its first line names only the C++ file that threw)."""
    import openvino as ov

    try:
        return ov.convert_model(source)
    except Exception as exc:  # the frontends raise OpConversionFailure, GeneralFailure and others
        raise ConversionError(
            f"openvino.convert_model could not convert {what} ({type(exc).__name__}: {openvino_cause(exc)}); "
            "export --format onnx or aoti instead"
        ) from exc


def openvino_cause(exc: BaseException) -> str:
    """The informative part of an OpenVINO error: its summary lines (``-- No conversion rule found for
    operations: ...``) where it has them, else its lines past the ``Check ... failed at FILE:LINE:`` header."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    summary = [ln.removeprefix("-- ") for ln in lines if ln.startswith("-- ")]
    useful = summary or [ln for ln in lines if not ln.startswith(("Check '", "Exception from "))]
    return "; ".join(useful[:3])[:400] if useful else first_line(exc)
