"""Backends called directly, timed beside tk's engines: the hand-built peers (a plain
``torch.compile`` with freezing, a plain onnxruntime session) and the bare session or compiled
module inside a loaded tk engine (tk's call overhead is the difference)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from tk.formats.inductor_freezing import inductor_freezing, register_float_weight_packing
from tk.runtime.base import Engine
from tk.runtime.eager import module_from_manifest
from tk.workflows.ort_session import plain_session

Call = Callable[[Mapping[str, np.ndarray]], Any]


class DirectEngine(Engine):
    """A backend called directly: ``run`` is the bare call, without tk's checks or conversions.

    It borrows the specs of an artifact so that ``tk.workflows.bench.measure`` can time it beside
    tk's engines on the same feeds. ``make_call`` runs on ``load`` and returns the call.
    """

    name = "direct"

    def __init__(self, like: Engine, make_call: Callable[[], Call]) -> None:
        super().__init__(like.root, like.manifest)
        self._make_call = make_call
        self._call: Call | None = None

    def _load(self) -> None:
        self._call = self._make_call()

    def _run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        return self.run(feeds)

    def run(self, feeds: Mapping[str, Any], *, check: bool = True) -> Any:  # measure() loads every engine first
        assert self._call is not None, "load() first"
        return self._call(feeds)

    def _close(self) -> None:
        self._call = None


def torch_call(fn: Callable[..., Any], order: list[str]) -> Call:
    """``fn(*tensors)`` under inference mode, the NumPy feeds wrapped (not copied) on every call.

    That is what a caller holding NumPy arrays does; tk's engines are timed from the same NumPy feeds.
    """

    def call(feeds: Mapping[str, np.ndarray]) -> Any:
        args = [torch.from_numpy(feeds[n]) for n in order]
        with torch.inference_mode():
            return fn(*args)

    return call


def peer_compile(like: Engine) -> DirectEngine:
    """torch.compile as the field notes tune it by hand: Inductor's freezing, static shapes (one graph per batch size)."""

    def make() -> Call:
        module = module_from_manifest(like.root, like.manifest)
        register_float_weight_packing()  # as the compile engine: not left out by an earlier unpacked frozen compile
        # options={"freezing": True} alone does not freeze: Dynamo reads the process-wide config when it traces
        call = torch_call(torch.compile(module, dynamic=False), [s.name for s in like.inputs])

        def frozen(feeds: dict[str, np.ndarray]) -> Any:
            with inductor_freezing():
                return call(feeds)

        return frozen

    return DirectEngine(like, make)


def peer_onnx(like: Engine, threads: int) -> DirectEngine:
    """An onnxruntime session built by hand on the same ONNX file (``tk.workflows.ort_session``)."""

    def make() -> Call:
        session = plain_session(like.root / like.manifest.file("onnx").path, threads)
        return lambda feeds: session.run(None, feeds)

    return DirectEngine(like, make)


def bare(engine: Engine) -> DirectEngine:
    """The very session or compiled module inside a loaded tk engine (onnx, compile, aoti), called directly."""

    def make() -> Call:
        order = [s.name for s in engine.inputs]
        if engine.name == "onnx":
            session = engine.session  # type: ignore[attr-defined]
            return lambda feeds: session.run(None, feeds)
        if engine.name == "compile":
            return torch_call(engine.compiled, order)  # type: ignore[attr-defined]
        if engine.name == "aoti":
            return torch_call(engine._model, order)  # type: ignore[attr-defined]  # AOTIEngine keeps it private
        raise ValueError(f"no bare call for engine {engine.name!r}")

    return DirectEngine(engine, make)
