"""The errors a user can cause. The CLI turns each into one line on stderr and exit code 2.

Anything that is not a ``TkError`` is a bug in ``tk`` and keeps its traceback.
"""

from __future__ import annotations


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


class BackendUnavailableError(TkError):
    """An engine or export format needs something this machine lacks (a package, a GPU)."""


class IntegrityError(TkError):
    """An artifact or checkpoint is missing, truncated, altered or unsafe to load."""


class ParityError(TkError):
    """An artifact's outputs differ from PyTorch's beyond tolerance."""

    exit_code = 1
