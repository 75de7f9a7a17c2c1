"""One engine choice: which engine(s), on which device, with which options, under which failure policy.

The command line builds an ``EngineChoice`` once (``tk.cli.common.engine_choice``) and every
workflow opens its engines with ``open_engine`` / ``open_engines``. Each engine takes the
options it declares (``Engine.option_names()``); an option that none of the engines opened
together declares is refused in one line, never dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tk.errors import UsageError
from tk.manifest import Manifest
from tk.registries import ENGINES
from tk.runtime.registry import engine_class, load
from tk.signing import TrustPolicy

if TYPE_CHECKING:
    from tk.runtime.base import Engine


FLAG_NAMES = {"dynamic": "--dynamic/--static"}  # options whose flag is not --NAME


@dataclass(frozen=True)
class EngineChoice:
    """How to open an artifact's engines. ``None`` option values mean "not given" and are dropped."""

    name: str = "onnx"  # one engine, or what the command takes besides: all, auto, comma-separated names
    device: str = "cpu"
    options: Mapping[str, Any] = field(default_factory=dict)  # option values by name (each engine takes its own)
    allow_failed: bool = False  # open an artifact whose export-time check failed
    trust: TrustPolicy | None = None  # whose native code runs (--public-key, --trust-artifact-code); default: own keys

    def __post_init__(self) -> None:
        given = {key: value for key, value in dict(self.options).items() if value is not None}
        object.__setattr__(self, "options", given)

    def replace(self, **changes: Any) -> EngineChoice:
        return dataclasses.replace(self, **changes)

    def with_defaults(self, values: Mapping[str, Any], engines: Sequence[str]) -> EngineChoice:
        """This choice plus the ``values`` not given, where one of ``engines`` declares them (a caller's own defaults)."""
        declared = set().union(*(engine_class(name).option_names() for name in engines))
        added = {key: value for key, value in values.items() if key in declared and key not in self.options}
        return self.replace(options={**added, **self.options}) if added else self

    def options_for(self, engine: str, among: Sequence[str] = ()) -> dict[str, Any]:
        """The options ``engine`` declares, after refusing any that no engine of ``among`` declares.

        ``among``: the engines opened together with this one (default: ``engine`` alone). A name no
        engine at all declares is kept, so that opening refuses it with the engine's valid names.
        """
        self.refuse_undeclared(among or (engine,))
        declared = engine_class(engine).option_names()
        takers = _takers()
        return {key: value for key, value in self.options.items() if key in declared or not takers.get(key)}

    def refuse_undeclared(self, engines: Sequence[str]) -> None:
        """Raise ``UsageError`` for a given option that no engine of ``engines`` declares but another does."""
        chosen = set().union(*(engine_class(name).option_names() for name in engines))
        takers = _takers()
        for key in self.options:
            if key not in chosen and takers.get(key):
                holders = takers[key]
                plural = "s" if len(holders) > 1 else ""
                flag = FLAG_NAMES.get(key, f"--{key.replace('_', '-')}")
                raise UsageError(f"{flag} applies to the {_join(holders)} engine{plural}, not {', '.join(engines)}")


def open_engine(
    root: str | Path,
    choice: EngineChoice,
    engine: str | None = None,
    *,
    manifest: Manifest | None = None,
    among: Sequence[str] = (),
) -> Engine:
    """Open ``engine`` (default: ``choice.name``) of the artifact at ``root`` as ``choice`` says.

    ``among``: the engines opened together with this one, for the refusal of options none of them
    declares (default: this engine alone). Verifies the artifact unless ``manifest`` is given.
    """
    name = engine or choice.name
    return load(
        root,
        name,
        device=choice.device,
        allow_failed=choice.allow_failed,
        manifest=manifest,
        options=choice.options_for(name, among),
        trust=choice.trust,
    )


def open_engines(
    stack: ExitStack, root: str | Path, choice: EngineChoice, names: Sequence[str], *, manifest: Manifest
) -> dict[str, Engine]:
    """Each engine of ``names`` opened by ``open_engine`` on ``stack`` (closed with it)."""
    return {
        name: stack.enter_context(open_engine(root, choice, name, manifest=manifest, among=names)) for name in names
    }


def _takers() -> dict[str, list[str]]:
    """Option name -> the registered engines that declare it."""
    takers: dict[str, list[str]] = {}
    for name in ENGINES:
        for key in engine_class(name).option_names():
            takers.setdefault(key, []).append(name)
    return takers


def _join(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
