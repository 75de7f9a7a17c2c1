"""The contract every engine keeps: specs, input checks, NumPy/torch in and out, and release.

Subclasses implement ``_load`` (open the session, load the program) and ``_run`` (one call of
the backend on feeds of its native kind), and declare their options as a frozen dataclass
(``Options``); unknown options are refused when the engine is opened. Loading happens on first
use, not in ``__init__``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from tk.errors import TkError, UsageError, run_failure
from tk.formats.tf32 import matmul_precision
from tk.manifest import Manifest
from tk.runtime.allocator import keep_freed_memory
from tk.runtime.dtypes import Array
from tk.runtime.inputs import check_arrays
from tk.signing import TrustPolicy
from tk.spec import Dim, TensorSpec


@dataclass(frozen=True)
class EngineOptions:
    """Options every engine takes. ``None`` means the default."""

    # intra-op threads: torch engines set torch's thread count for each call and restore it after
    # (torch's count is process-wide: threads calling with different counts at once see each other's),
    # onnxruntime gives its session this many; default: torch's current count / every usable core
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise UsageError(f"engine option: threads must be a positive integer, got {self.threads!r}")


@dataclass(frozen=True)
class GraphOptions(EngineOptions):
    """Options of the torch engines that can replay CUDA graphs."""

    cuda_graph: bool = False  # on CUDA: capture each input shape once into a CUDA graph, then replay it
    max_graphs: int = 8  # shapes captured at most; further shapes run without a graph


def make_options(cls: type[EngineOptions], engine: str, values: Mapping[str, Any]) -> EngineOptions:
    """``cls(**values)``, refusing a name ``cls`` does not declare with the list of those it does."""
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise UsageError(
            f"engine {engine!r}: unknown option(s) {', '.join(unknown)}; it takes {', '.join(valid) or 'none'}"
        )
    return cls(**values)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``threads`` inside the block, restored after (no-op for None)."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class TritonBackend:
    """How Triton Inference Server serves an engine's file (``tk deploy triton``, ``tk serve``'s config)."""

    platform: str  # config.pbtxt's platform (onnxruntime_onnx, tensorrt_plan)
    model_file: str  # the file name Triton's backend loads from the version directory
    gpu: bool = False  # the backend runs on a GPU (instance_group KIND_GPU)
    # the key of the manifest's format record holding an optimization profile that fixes the dims (a plan's)
    profile_key: str | None = None
    preference: int = 9  # deploy's default format: the artifact's one whose backend has the lowest


class Engine(ABC):
    """One loaded artifact that runs feeds; use it as a context manager to release it."""

    name: ClassVar[str]
    native: ClassVar[str] = "torch"  # the kind of arrays ``_run`` takes and returns: torch or numpy
    Options: ClassVar[type[EngineOptions]] = EngineOptions
    triton: ClassVar[TritonBackend | None] = None  # the Triton backend that serves this engine's file, if one does

    @classmethod
    def triton_files(cls, root: Path, manifest: Any) -> dict[str, bytes]:
        """The files Triton's backend loads for this engine (``triton``), by name, from their verified bytes."""
        from tk.manifest import read_verified
        from tk.registries import ENGINE_FILE_ROLE

        assert cls.triton is not None
        return {cls.triton.model_file: read_verified(root, manifest.file(ENGINE_FILE_ROLE[cls.name]))}

    @classmethod
    def probe_call(cls, model: Any, feeds: dict[str, Any], like: Engine,
                   options: Mapping[str, Any] | None = None) -> Callable[[], object]:  # fmt: skip
        """A call of ``model`` on ``feeds`` as this engine runs an artifact's file: ``model`` is a writer's
        in-memory model (what an int8 writer hands ``tk optimize``'s speed gate: ``tk.export.context.Int8Model``),
        ``like`` an opened engine of the same signature (its manifest and dims), ``options`` one of the engine's
        ``tuned_options`` (an engine that offers none takes none)."""
        raise NotImplementedError(f"the {cls.name} engine runs no in-memory model")

    def __init__(
        self,
        root: str | Path,
        manifest: Manifest,
        *,
        device: str = "cpu",
        options: EngineOptions | Mapping[str, Any] | None = None,
        trust: TrustPolicy | None = None,
    ) -> None:
        self.root = Path(root)
        self.trust = trust or TrustPolicy()  # whose signatures let native code (or user model code) load
        self.manifest = manifest
        self.device = device
        if not isinstance(options, EngineOptions):
            options = make_options(self.Options, self.name, options or {})
        elif not isinstance(options, self.Options):
            raise UsageError(f"engine {self.name!r}: expected {self.Options.__name__}, got {type(options).__name__}")
        self.options: Any = options
        self._loaded = False
        self._load_lock = threading.Lock()

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The options this engine declares (the fields of its ``Options``)."""
        return frozenset(f.name for f in dataclasses.fields(cls.Options))

    @classmethod
    def tuned_options(cls, batch: int, cores: int) -> list[dict[str, Any]]:
        """Option settings worth timing beside the defaults for a batch of ``batch`` samples on ``cores``
        cores: ``tk optimize`` times each and records the fastest for ``--engine auto``. None by default."""
        return []

    # -- what subclasses provide -------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls, device: str = "cpu") -> str | None:
        """Why this engine cannot run here (a missing package, no GPU), or None if it can."""
        return None

    @classmethod
    def precision_reason(cls, precision: str, device: str = "cpu") -> str | None:
        """Why this engine cannot run an artifact of ``precision`` here (its kernels lack the dtype), or None."""
        return None

    @abstractmethod
    def _load(self) -> None: ...

    @abstractmethod
    def _run(self, feeds: dict[str, Any]) -> dict[str, Any]: ...

    def _close(self) -> None:  # noqa: B027 - optional hook
        pass

    # -- the public contract -----------------------------------------------------------------
    @property
    def inputs(self) -> list[TensorSpec]:
        return self.manifest.signature.inputs

    @property
    def outputs(self) -> list[TensorSpec]:
        return self.manifest.signature.outputs

    @property
    def dims(self) -> dict[str, Dim]:
        return self.manifest.signature.dims

    def load(self) -> Engine:
        if not self._loaded:
            with self._load_lock:
                if not self._loaded:
                    keep_freed_memory()  # before the first call's tensors: each call reuses the last one's memory
                    self._load()
                    self._loaded = True
        return self

    def run(self, feeds: Mapping[str, Array], *, check: bool = True) -> dict[str, Array]:
        """Run one batch. NumPy in gives NumPy out; torch in gives torch out (on the engine's device).

        ``check=False`` skips the input checks, for a caller that already checked feeds of this
        shape and dtype (``check_feeds``); a wrong feed then fails inside the backend.
        """
        if check:
            self.check_feeds(feeds)
        if not self._loaded:
            self.load()
        as_torch = isinstance(next(iter(feeds.values())), torch.Tensor) if feeds else False
        native = {name: self._to_native(value) for name, value in feeds.items()}
        try:
            if self.native == "torch":
                with torch_threads(self.options.threads), matmul_precision(self.manifest.precision == "tf32"):
                    outputs = self._run(native)
            else:
                outputs = self._run(native)
        except TkError:
            raise
        except Exception as exc:  # any backend failure (onnxruntime's pybind errors, torch's) is one line
            raise run_failure(exc, self.name) from exc
        return {name: _convert(value, as_torch) for name, value in outputs.items()}

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, **options: Any) -> Any:
        """Generate from a decoder artifact's ``prompts`` (token ids): ``tk.runtime.generation.generate_with_engine``
        (``sampling``, ``stop_ids``, ``on_tokens``, ``keep_logits``); returns its ``Generated``."""
        from tk.runtime.generation import generate_with_engine

        return generate_with_engine(self, prompts, max_new_tokens=max_new_tokens, **options)

    @property
    def keeps_cache(self) -> bool:
        """Whether a decoder artifact's graph keeps its KV cache itself (then ``kept_cache`` runs it); most
        engines run the artifact's step, which takes the cache and returns the new keys and values."""
        return False

    @property
    def kept_cache_itemsize(self) -> int:
        """Bytes of one value of the cache the engine keeps (where ``keeps_cache``)."""
        return 4

    def kept_cache(self, own_request: bool = False) -> Any:
        """Where ``keeps_cache``: the cache the engine keeps (``tk.runtime.generation.KeptCache``), in the calling
        thread's session, or (``own_request``) in one of its own."""
        raise NotImplementedError(f"engine {self.name!r} runs the artifact's step with the cache as feeds")

    def settings(self) -> dict[str, Any]:
        """The settings this engine runs with (recorded in benchmark JSON); subclasses add theirs."""
        threads = self.options.threads or torch.get_num_threads()
        return {"device": self.device, **dataclasses.asdict(self.options), "torch_threads": threads,
                "malloc": keep_freed_memory()}  # fmt: skip

    def close(self) -> None:
        if self._loaded:
            self._close()
            self._loaded = False

    def __enter__(self) -> Engine:
        return self.load()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- input checks --------------------------------------------------------------------------
    def check_feeds(self, feeds: Mapping[str, Array]) -> dict[str, int]:
        """Check names, dtypes, ranks, sizes and values against the specs; return the dimension sizes."""
        return check_arrays(feeds, self.inputs, dims=self.dims, source=None, exact_dtype=True, check_batch_range=True)

    def _to_native(self, value: Array) -> Any:
        if self.native == "numpy":
            return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
        return torch.from_numpy(value) if isinstance(value, np.ndarray) else value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r}, device={self.device!r})"


def rebuild_command(manifest: Manifest, fmt: str, device: str) -> str:
    """The ``tk export`` command that writes ``fmt`` for ``device`` from the same model."""
    model = manifest.model
    size = f" --size {model['size']}" if model.get("size") else ""
    inputs = "".join(f" --input {d}" for d in model.get("input_descriptions") or ())
    return f"tk export {model['name']}{size}{inputs} --format {fmt} --device {device}"


def _convert(value: Any, as_torch: bool) -> Array:
    if as_torch:
        return torch.from_numpy(value) if isinstance(value, np.ndarray) else value
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dtype == torch.bfloat16:
            value = value.float()
        return value.cpu().numpy()
    return value
