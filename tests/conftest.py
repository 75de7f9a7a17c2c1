"""Shared fixtures and the one hardware gate every GPU/TensorRT test uses.

Tiny artifacts are exported once per test session (AOTInductor compiles take 10-50 s each on two
cores) under the session's base temporary directory; tests that alter an artifact copy it first.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tk.export import ExportOptions
from tk.manifest import FileEntry, Manifest, manifest_bytes, read_manifest
from tk.models import ModelSpec, build_model, entries
from tk.workflows.export import export

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def missing_requirements(
    *,
    cuda: bool = False,
    tensorrt: bool = False,
    min_compute_capability: tuple[int, int] | None = None,
    openvino: bool = False,
) -> list[str]:
    """Every requirement of a hardware-gated test that this machine lacks."""
    missing = []
    has_cuda = torch.cuda.is_available()
    if (cuda or tensorrt or min_compute_capability) and not has_cuda:
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    if tensorrt and importlib.util.find_spec("tensorrt") is None:
        missing.append("the tensorrt package (pip install 'tk[gpu]')")
    if min_compute_capability and has_cuda and torch.cuda.get_device_capability() < min_compute_capability:
        got = "{}.{}".format(*torch.cuda.get_device_capability())
        missing.append(f"compute capability >= {min_compute_capability[0]}.{min_compute_capability[1]} (found {got})")
    if openvino and importlib.util.find_spec("openvino") is None:
        missing.append("the openvino package (pip install 'tk[openvino]')")
    return missing


def requires(**kwargs: object) -> pytest.MarkDecorator:
    """``@requires(cuda=True, tensorrt=True)`` (or ``openvino=True``): skip with every missing requirement in the reason."""
    missing = missing_requirements(**kwargs)  # type: ignore[arg-type]
    return pytest.mark.skipif(bool(missing), reason="needs " + "; ".join(missing) if missing else "")


@pytest.fixture(scope="session", autouse=True)
def own_signing_key_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The user's config directory (signing key, trusted keys) for this session: never the real ~/.config.

    Set in ``os.environ`` so that ``tk`` run in a subprocess signs and verifies with the same key.
    """
    saved = {k: os.environ.get(k) for k in ("XDG_CONFIG_HOME", "TK_TRUSTED_KEYS", "TK_SIGNING_KEY")}
    config = tmp_path_factory.mktemp("xdg-config")
    os.environ["XDG_CONFIG_HOME"] = str(config)
    os.environ.pop("TK_TRUSTED_KEYS", None)
    os.environ.pop("TK_SIGNING_KEY", None)
    yield config
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def quiet_machine() -> Iterator[None]:
    """Every load guard of the code under test reads a quiet machine (load 0, no other process on the
    CPU): no test's verdict may depend on what else runs beside the suite. A test of the busy path hands
    its guard readers of its own, or replaces these (``tk.measure.load_guard.system``). Session-wide,
    so module fixtures that run tk optimize or tk bench see it too."""
    from tk.measure import load_guard

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(load_guard.system, "load", lambda: 0.0)
        patch.setattr(load_guard.system, "cpu", lambda: (0.0, 0.0))
        yield


MODELS = ("transformer", "mlp", "linear", "resnet18")


@dataclass
class Exported:
    spec: ModelSpec  # the model as exported (float32, eval mode, the artifact's weights)
    root: Path
    manifest: Manifest


def shared_artifact_dir(
    tmp_path_factory: pytest.TempPathFactory, name: str, formats: tuple[str, ...], dynamic: bool
) -> Path:
    """Where this session keeps the tiny ``name`` exported in ``formats`` (tests/runtime uses the same place)."""
    kind = "dynamic" if dynamic else "static"
    return tmp_path_factory.getbasetemp() / "tk-artifacts" / f"{name}-{'-'.join(formats)}-{kind}"


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Exported]:
    """``exported(name, formats, dynamic=True)``: the tiny model exported (and checked) once per session."""
    cache: dict[tuple[str, tuple[str, ...], bool], Exported] = {}

    def get(name: str, formats: tuple[str, ...], dynamic: bool = True) -> Exported:
        key = (name, formats, dynamic)
        if key not in cache:
            entry = entries()[name]
            if not entry.available():
                pytest.skip(f"model {name!r} needs {entry.requires}")
            torch.manual_seed(0)
            spec = build_model(name, size="tiny")
            root = shared_artifact_dir(tmp_path_factory, name, formats, dynamic)
            if (root / "manifest.json").is_file():
                from tk.models.checkpoint import load_weights

                load_weights(spec.module, root / "weights.safetensors")
            else:
                export(spec, root, ExportOptions(formats=formats, dynamic=dynamic))
            spec.module.eval()
            cache[key] = Exported(spec, root, read_manifest(root))
        return cache[key]

    return get


def _eager_outputs(spec: ModelSpec, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    args = [torch.from_numpy(feeds[s.name]) for s in spec.signature.inputs]
    with torch.inference_mode():
        out = spec.module(*args)
    values = out if isinstance(out, (tuple, list)) else [out]
    return {s.name: v.numpy() for s, v in zip(spec.signature.outputs, values, strict=True)}


def _other_sizes(spec: ModelSpec) -> dict[str, int]:
    picks = {"batch": 3, "seq": 7}
    sizes = {}
    for name, dim in spec.signature.dims.items():
        size = picks.get(name, dim.min + 1)
        assert dim.min <= size <= dim.max and size != dim.opt, (name, dim)
        sizes[name] = size
    return sizes


@pytest.fixture(scope="session")
def eager_outputs() -> Callable[[ModelSpec, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """``eager_outputs(spec, feeds)``: the PyTorch model's outputs on NumPy feeds, keyed by output name."""
    return _eager_outputs


@pytest.fixture(scope="session")
def other_sizes() -> Callable[[ModelSpec], dict[str, int]]:
    """``other_sizes(spec)``: dimension sizes unlike the example's (batch 3, seq 7), inside every range."""
    return _other_sizes


def assert_close(actual: dict[str, Any], expected: dict[str, np.ndarray], rtol: float, atol: float) -> dict[str, float]:
    """Every output within ``atol + rtol * |expected|``; returns the max abs error per output."""
    assert sorted(actual) == sorted(expected)
    errors = {}
    for name, want in expected.items():
        got = np.asarray(actual[name])
        assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
        errors[name] = float(np.abs(got.astype(np.float64) - want).max()) if want.size else 0.0
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"output {name!r}")
    return errors


@pytest.fixture(scope="session")
def close() -> Callable[..., dict[str, float]]:
    """``close(actual, expected, rtol, atol)``: assert every output is within tolerance."""
    return assert_close


@pytest.fixture
def copy_of(tmp_path: Path) -> Callable[[Path, str], Path]:
    """``copy_of(root, name)``: a copy of the artifact at ``root`` as ``tmp_path / name``, to tamper with."""

    def copy(root: Path, name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(root, target)
        return target

    return copy


def rehash(root: Path, replaced: dict[str, bytes] | None = None) -> None:
    """Write ``replaced`` files and recompute every hash and the manifest checksum, as anyone without a key can."""
    for name, data in (replaced or {}).items():
        (root / name).write_bytes(data)
    manifest = read_manifest(root)
    manifest.files = [FileEntry.of(root, e.path, e.role) for e in manifest.files]
    (root / "manifest.json").write_bytes(manifest_bytes(manifest))


def package_source(root: Path) -> str:
    """The C++ AOTInductor generated for an artifact's package (what its kernels call)."""
    import zipfile

    with zipfile.ZipFile(root / "model.aoti.pt2") as archive:
        return "\n".join(archive.read(n).decode(errors="replace") for n in archive.namelist() if n.endswith(".cpp"))


def runner_of_package(root: Path) -> Any:
    """torch's runner of an artifact's package model library, its constants where AOTInductor's loader put them."""
    from tk.formats.aoti import FILE
    from tk.runtime.aoti_package import _model_library
    from tk.safefiles import private_copy

    files = _model_library((root / FILE).read_bytes())
    assert files is not None
    with private_copy(files) as copy:
        return torch._C._aoti.AOTIModelContainerRunnerCpu(str(copy / "model.so"), 1)


def run_in_threads(work: Callable[[], None], threads: int = 4) -> list[BaseException]:
    """Run ``work`` in ``threads`` threads at once; return what any of them raised."""
    return run_each_in_thread(lambda _: work(), threads)


def run_each_in_thread(work: Callable[[int], None], count: int, *, timeout: float | None = None) -> list[BaseException]:
    """Run ``work(0)`` ... ``work(count - 1)`` each in its own thread, all at once; wait for each up to
    ``timeout`` seconds (default: no limit) and return what any of them raised."""
    import threading

    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            work(index)
        except BaseException as exc:  # collected, so a failure in a thread fails the test
            errors.append(exc)

    started = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in started:
        t.start()
    for t in started:
        t.join(timeout)
    return errors


FINISHED_SESSION = pytest.StashKey[pytest.Session]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    session.config.stash[FINISHED_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """With ``TK_TESTS_EXIT_AFTER_REPORT=1`` (set by scripts/test.sh), leave with pytest's own exit status
    once everything is reported, without Python's interpreter finalization.

    One CI run printed "787 passed" and then died of SIGSEGV (exit 139) while Python tore down the native
    runtimes that this one process had loaded side by side (torch, Inductor's workers, onnxruntime, OpenVINO,
    NNCF, torchao, an in-process Ray); no test can pass or fail there. No ``tk`` command loads all of them
    at once, and the tests that run ``tk`` in a subprocess assert its exit code, so a crash at a user's
    exit would still fail them. scripts/test.sh also sets PYTHONFAULTHANDLER, which names where any
    earlier crash happened.
    """
    session = config.stash.get(FINISHED_SESSION, None)
    if os.environ.get("TK_TESTS_EXIT_AFTER_REPORT") == "1" and session is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(session.exitstatus))


DEADLINE_ENV = "TK_TESTS_DEADLINE"  # Unix time by which the run must be over (.ci/run: CI's 30 minutes)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``fits(seconds=N)`` run last, the shortest first (a stable sort), so that the time
    left is known when each starts: on a slow machine the longest are the ones left out."""

    def need(item: pytest.Item) -> tuple[bool, float]:
        marker = item.get_closest_marker("fits")
        return (marker is not None, float(marker.kwargs["seconds"]) if marker else 0.0)

    items.sort(key=need)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A ``fits(seconds=N)`` test runs only if about N seconds are left before ``TK_TESTS_DEADLINE``
    (no deadline: it always runs); else it is skipped, saying so, before its fixtures start."""
    marker = item.get_closest_marker("fits")
    deadline = os.environ.get(DEADLINE_ENV)
    if marker is None or not deadline:
        return
    import time

    needed, left = float(marker.kwargs["seconds"]), float(deadline) - time.time()
    if left < needed:
        pytest.skip(
            f"{item.nodeid} does not fit: needs about {needed:.0f} s, {max(left, 0):.0f} s left before {DEADLINE_ENV}"
        )
