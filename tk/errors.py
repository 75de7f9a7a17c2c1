"""The errors a user can cause. The CLI turns each into one line on stderr and exit code 2.

Anything that is not a ``TkError`` is a bug in ``tk`` and keeps its traceback.
"""

from __future__ import annotations

import re


class TkError(Exception):
    """Base of every error a user can cause; its message is one line a person can act on."""

    exit_code = 2


class UsageError(TkError):
    """A bad option, model name, input description or file."""


class InputError(TkError):
    """Feeds that do not match an engine's input specs (names, dtype, rank, dimension ranges)."""


class CaptureError(TkError):
    """torch.export (or torch.compile with fullgraph) could not capture the model as one graph."""


class ConversionError(TkError):
    """A captured graph could not be turned into ONNX, a TensorRT engine or an AOTInductor package."""


class PartialExportError(ConversionError):
    """Some formats could not be converted; the artifact was written with the others (its manifest names the failures)."""


class BackendUnavailableError(TkError):
    """An engine or export format needs something this machine lacks (a package, a GPU)."""


class IntegrityError(TkError):
    """An artifact or checkpoint is missing, truncated, altered or unsafe to load."""


class UntrustedArtifactError(IntegrityError):
    """An artifact's native code (AOTInductor, TensorRT) is not signed by a key the user trusts."""


class EngineError(TkError):
    """A backend failed while running feeds that passed the input checks (its message is quoted)."""


class CannotWinError(TkError):
    """An int8 exclusion search left unrun: with every layer int8 the artifact is already slower than a
    candidate that passed (``tk optimize``), and leaving layers in float32 cannot make it the fastest."""


class ParityError(TkError):
    """An artifact's outputs differ from PyTorch's beyond tolerance."""

    exit_code = 1


# a line that only says where C++ threw ("Exception from src/inference/src/cpp/core.cpp:105:"): OpenVINO
# stacks one per frame above the line that says what went wrong
_WHERE_THROWN = re.compile(r"Exception from \S+:\d+:?")


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message that says something (not blank, not a ``#`` banner, not a
    C++ location banner), or its type's name: what a one-line error quotes."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.strip().startswith("#")]
    said = [line for line in lines if not _WHERE_THROWN.fullmatch(line)]
    return (said or lines or [type(exc).__name__])[0]


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` reports memory running out (host or GPU), whatever the library that raised it."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return "out of memory" in text or "failed to allocate" in text or "bad_alloc" in text


class ResourceError(TkError):
    """The machine ran out of something the command needed (memory, GPU memory)."""


def load_failure(exc: BaseException, what: str, fix: str) -> TkError:
    """The error for a file that failed to load: out of memory and missing libraries say so;
    anything else is a damaged or foreign file (``what``: the file; ``fix``: the next step)."""
    if is_out_of_memory(exc):
        return ResourceError(f"{what}: out of memory while loading it ({first_line(exc)}); free memory and retry")
    text = str(exc)
    if isinstance(exc, ImportError) or "cannot open shared object" in text or "undefined symbol" in text:
        return BackendUnavailableError(f"{what}: a library it needs cannot be loaded ({first_line(exc)})")
    return IntegrityError(f"{what}: cannot load it ({type(exc).__name__}: {first_line(exc)}); {fix}")


def run_failure(exc: BaseException, engine: str) -> TkError:
    """The error for a backend that failed while running: out of memory says so."""
    if is_out_of_memory(exc):
        return ResourceError(
            f"engine {engine!r} ran out of memory ({first_line(exc)}); use a smaller --batch-size or free memory"
        )
    return EngineError(f"engine {engine!r} failed while running ({type(exc).__name__}: {first_line(exc)})")
