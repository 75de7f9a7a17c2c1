"""The candidates ``tk optimize`` tries: every format x precision x setting, and why some are skipped.

Formats and engines come from the registries (``tk.registries``), so a format added there (OpenVINO,
say) becomes a candidate with no change here. A candidate is skipped, with its reason, where this
machine cannot run it or where it cannot win: bfloat16 without AVX512-BF16/AMX runs emulated, and
float16 has no fast CPU kernels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from tk.errors import UsageError
from tk.registries import ENGINE_FILE_ROLE, ENGINES, FORMATS

PRECISIONS = ("fp32", "bf16", "fp16", "int8")
FP16_FLAGS = ("avx512_fp16", "amx_fp16")  # a CPU without them runs float16 products emulated


@dataclass(frozen=True)
class Candidate:
    """One artifact setting: a format written at a precision with its writer's options, run by an engine."""

    format: str
    precision: str
    engine: str
    options: Any = None  # the writer's Options object for this variant (``Writer.variants``); None: its defaults

    @property
    def settings(self) -> Any:
        """The writer's options this candidate is written with (its defaults where none were given)."""
        return self.options if self.options is not None else writer_of(self.format).Options()

    @property
    def name(self) -> str:
        words = [self.format, self.precision, *writer_of(self.format).variant_words(self.settings, self.precision)]
        if self.engine != self.format:
            words.append(f"({self.engine})")
        return " ".join(words)

    @property
    def group(self) -> tuple[str, tuple[str, Any] | None]:
        """Candidates of one group are written by one export (one capture): the precision, and None for every
        format's default settings (they share a capture), else this format with its own."""
        if self.settings == writer_of(self.format).Options():
            return self.precision, None
        return self.precision, (self.format, self.settings)

    @property
    def export_options(self) -> dict[str, Any]:
        """The writer options this candidate sets beyond the defaults, by field name (for the JSON record)."""
        settings, default = self.settings, writer_of(self.format).Options()
        if not dataclasses.is_dataclass(settings):
            return {}
        return {
            f.name: getattr(settings, f.name)
            for f in dataclasses.fields(settings)
            if getattr(settings, f.name) != getattr(default, f.name)
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "precision": self.precision,
            "engine": self.engine,
            "options": self.export_options,
        }


def writer_of(fmt: str) -> Any:
    """The writer of format ``fmt`` (``tk.export.registry.writer``)."""
    from tk.export.registry import writer

    return writer(fmt)


@dataclass
class Skipped:
    candidate: Candidate
    reason: str


@dataclass
class CandidateSet:
    tried: list[Candidate] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def engine_for(fmt: str) -> str | None:
    """The engine that runs format ``fmt`` (the first registered engine whose file role it is)."""
    return next((name for name in ENGINES if ENGINE_FILE_ROLE[name] == fmt), None)


def variants(fmt: str, precision: str) -> list[Any]:
    """The export settings worth trying for one format at one precision: its writer's (``Writer.variants``),
    the default as None."""
    found = writer_of(fmt).variants(precision)
    default = writer_of(fmt).Options()
    return [None if options == default else options for options in found]


def enumerate_candidates(
    device: str,
    *,
    formats: tuple[str, ...] | None = None,
    precisions: tuple[str, ...] | None = None,
    names: tuple[str, ...] | None = None,
) -> CandidateSet:
    """Every format x precision x setting of the registries; those that cannot run or win here skipped.

    ``formats``, ``precisions`` and ``names`` (candidate names such as ``onnx int8 dynamic``) narrow the set."""
    found = CandidateSet()
    for flag, given, allowed in (("--formats", formats, FORMATS), ("--precisions", precisions, PRECISIONS)):
        if given is not None and (wrong := [g for g in given if g not in allowed]):
            raise UsageError(f"{flag}: unknown {', '.join(wrong)}; expected some of {', '.join(allowed)}")
    known = {Candidate(f, p, engine_for(f) or f, o).name for p in PRECISIONS for f in FORMATS for o in variants(f, p)}
    unknown = sorted(set(names or ()) - known)
    if unknown:
        raise UsageError(
            f"--candidates: unknown {', '.join(unknown)}; expected names such as {', '.join(sorted(known)[:4])}"
        )
    for precision in PRECISIONS:
        for fmt in FORMATS:
            engine = engine_for(fmt)
            for options in variants(fmt, precision):
                candidate = Candidate(fmt, precision, engine or fmt, options)
                reason = skip_reason(candidate, device, formats, precisions, engine_known=engine is not None)
                if reason is None and names is not None and candidate.name not in names:
                    reason = "not among --candidates"
                if reason is None:
                    found.tried.append(candidate)
                else:
                    found.skipped.append(Skipped(candidate, reason))
    return found


def nothing_to_try(skipped: list[Skipped]) -> str:
    """Why no candidate runs, in one line: the reasons of those the options asked for (all where none was),
    each once, with the candidates it names."""
    asked = [s for s in skipped if not s.reason.startswith("not among --")] or skipped
    by_reason: dict[str, list[str]] = {}
    for s in asked:
        by_reason.setdefault(s.reason, []).append(s.candidate.name)
    parts = [
        f"{', '.join(names) if len(names) <= 3 else f'{len(names)} candidates'}: {reason}"
        for reason, names in by_reason.items()
    ]
    return "no candidate can run here: " + "; ".join(parts)


def skip_reason(
    candidate: Candidate,
    device: str,
    formats: tuple[str, ...] | None,
    precisions: tuple[str, ...] | None,
    *,
    engine_known: bool = True,
) -> str | None:
    """Why ``candidate`` is not tried here, or None."""
    if formats is not None and candidate.format not in formats:
        return "not among --formats"
    if precisions is not None and candidate.precision not in precisions:
        return "not among --precisions"
    if not engine_known:
        return f"no engine runs the {candidate.format} format"
    from tk.export import format_unavailable_reason, writer_options_reason

    reason = writer_options_reason(candidate.format, candidate.settings, device, candidate.precision)
    if reason:
        return reason
    from tk.runtime import unavailable_reason

    reason = format_unavailable_reason(candidate.format, device, candidate.precision)
    reason = reason or unavailable_reason(candidate.engine, device, candidate.precision)
    if reason:
        return reason
    return hardware_reason(candidate.precision, device)


def hardware_reason(precision: str, device: str, flags: frozenset[str] | None = None) -> str | None:
    """Why ``precision`` cannot win on this CPU (it would run emulated), or None."""
    if device != "cpu":
        return None
    from tk.formats.aoti import cpu_flags
    from tk.measure.hardware import cpu_precision_reason

    flags = cpu_flags() if flags is None else flags
    if precision == "bf16":
        return cpu_precision_reason("bf16", flags)
    if precision == "fp16" and not any(f in flags for f in FP16_FLAGS):
        native = [p for p in ("bf16", "int8") if cpu_precision_reason(p, flags) is None] or ["float32"]
        its = f"{' and '.join(native)} {'is' if len(native) == 1 else 'are'} the CPU's"
        return f"this CPU has no {' or '.join(FP16_FLAGS)}: float16 products would run emulated ({its})"
    return None


def group_key(parts: dict[str, Any]) -> str:
    """A stable hash of what decides a group's artifact (model, checkpoint, options, versions)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def int8_layers(manifest_format: dict[str, Any]) -> tuple[int, int] | None:
    """(layers int8, layers that could be) of an int8 format's manifest record; None when it does not say."""
    quant = manifest_format.get("quantization")
    if not isinstance(quant, dict):
        return None
    total = int(quant.get("quantizable_nodes", quant.get("quantizable_modules", 0)) or 0)
    int8 = quant.get("int8_modules", total - len(quant.get("excluded", [])))
    return int(int8), total


def layers_text(manifest_format: dict[str, Any]) -> str | None:
    """How many of an int8 format's layers run in each precision ("34 of 36 layers int8, 2 bf16"): the layers
    left out of int8 run in bfloat16 where the aoti or OpenVINO writer chose it (``automatic_exclusions_run_in``),
    else float32 (onnx's QDQ graphs run them in float32)."""
    layers = int8_layers(manifest_format)
    if layers is None:
        return None
    int8, total = layers
    rest = manifest_format["quantization"].get("automatic_exclusions_run_in") or "fp32"
    return f"{int8} of {total} layers int8" + (f", {total - int8} {rest}" if total > int8 else "")
