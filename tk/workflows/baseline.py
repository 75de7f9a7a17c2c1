"""Baselines: last week's accuracy and speed, recorded, so that this week's artifact is judged against them.

An accuracy baseline holds, per engine and output, the figures of a ``tk check`` (max abs error,
SQNR, cosine, top-1 agreement for class scores) and the recipe of its inputs (seed, shapes,
sample count, the hash of an input or golden file), so a later check recomputes them on the same
inputs. A speed baseline holds each engine's speed-up over eager at each batch size measured in
the same run, never absolute times (they do not travel between machines), and the CPU it ran on:
ratios do not travel between CPUs either, so another CPU's baseline is refused unless asked.

Both are JSON files with a kind and a version; reading validates them, and a damaged or foreign
file is one ``UsageError`` line. ``accuracy_gate`` and ``speed_gate`` turn a run and an optional
baseline into ``Verdict``s (one per engine × output or batch size × figure), the rows of the
before/after table and of the JUnit file (``tk.workflows.junit``).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tk.errors import ParityError, UsageError, first_line
from tk.fileio import atomic_write_json, sha256_file
from tk.parity import figures_measured
from tk.registries import ENGINES, PRECISIONS

if TYPE_CHECKING:
    from rich.table import Table

    from tk.parity import ParityReport
    from tk.workflows.bench import BenchReport
    from tk.workflows.check import CheckResult

FORMAT = "tk-baseline"
VERSION = 1
ACCURACY, SPEED = "accuracy", "speed"
SQNR_CAP_DB = 120.0  # a baseline's SQNR counts as at most this: above it, float32 rounding decides, not the artifact
DEFAULT_MAX_SLOWDOWN_PCT = 10.0  # tk bench --baseline: a speed-up may drop by this share before it fails
SPEED_FLAG_PREFIXES = ("avx512", "amx", "avx_vnni", "avx2", "fma")  # CPU flags that decide speed ratios
FIGURES = ("max_abs", "sqnr_db", "cosine", "top1")  # accuracy figures, in table order
FIGURE_ALIASES = {"sqnr": "sqnr_db", "top1_pct": "top1", "max-abs": "max_abs"}
MAX_SEED = 2**32 - 1  # the largest seed numpy's and torch's generators take (tk check --seed)
IO_MODES = ("host", "device")  # tk bench --io


@dataclass(frozen=True)
class Margins:
    """How far each accuracy figure may fall below its baseline before the check fails.

    max abs error: at most ``max_abs`` × the baseline's + ``max_abs_atol`` (None: the absolute
    tolerance the baseline's output was checked with); SQNR: at most ``sqnr_db`` dB lower (a
    baseline above 120 dB counts as 120); cosine: at most ``cosine`` lower; top-1 agreement: at
    most ``top1`` percentage points lower. Defaults: 1.5×+atol, 1 dB, 1e-4, 0.5 points.
    """

    max_abs: float = 1.5
    max_abs_atol: float | None = None
    sqnr_db: float = 1.0
    cosine: float = 1e-4
    top1: float = 0.5


def parse_margins(items: Sequence[str]) -> Margins:
    """``FIGURE=VALUE`` items (``--margin``): ``sqnr_db=2``, ``cosine=1e-3``, ``top1=1``, ``max_abs=2`` or ``max_abs=2:1e-4``."""
    margins = Margins()
    for item in items:
        name, sep, text = item.partition("=")
        name = FIGURE_ALIASES.get(name.strip(), name.strip())
        if not sep or name not in FIGURES:
            raise UsageError(f"--margin: expected FIGURE=VALUE with FIGURE one of {', '.join(FIGURES)}, got {item!r}")
        try:
            if name == "max_abs":
                factor, _, atol = text.partition(":")
                margins = replace(margins, max_abs=float(factor), max_abs_atol=float(atol) if atol else None)
                values = [margins.max_abs] + ([margins.max_abs_atol] if atol else [])
            else:
                margins = replace(margins, **{name: float(text)})
                values = [getattr(margins, name)]
        except ValueError:
            raise UsageError(f"--margin {name}: expected a number, got {text!r}") from None
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise UsageError(f"--margin {name}: expected a finite number of 0 or more, got {text!r}")
    return margins


@dataclass
class Verdict:
    """One figure of one engine's output (or batch size), judged against its baseline when there is one."""

    suite: str  # check or bench
    engine: str
    item: str  # an output's name, or "batch N"
    figure: str  # max_abs, sqnr_db, cosine, top1, parity (the check's own tolerances), speedup, run
    value: float | None = None  # now (None: not measured, or an SQNR of an exact match)
    baseline: float | None = None
    limit: float | None = None  # the worst value that passes
    margin: str = ""  # the margin applied, in words
    status: str = "pass"  # pass, fail or skip
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "fail"


@dataclass
class Gate:
    """The verdicts of one run, and notes for people (a busy machine, another CPU allowed)."""

    suite: str
    verdicts: list[Verdict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    judged: bool = False  # whether a baseline was compared
    unmatched: str | None = None  # a baseline was given and nothing in it was run (the line to end with)

    @property
    def passed(self) -> bool:
        return not any(v.failed for v in self.verdicts)

    def failures(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.failed]

    def raise_if_failed(self) -> None:
        failed = self.failures()
        if failed:
            shown = "; ".join(v.message for v in failed[:4])
            more = f" (and {len(failed) - 4} more)" if len(failed) > 4 else ""
            raise ParityError(f"{self.suite}: {len(failed)} figure(s) failed: {shown}{more}")


# ---------------------------------------------------------------- recipes


@dataclass
class Recipe:
    """How a check's inputs were made, so a later check makes the same ones."""

    seed: int = 0
    samples: int | None = None  # N random samples, or None: random inputs at each checked shape
    batch_size: int | None = None
    inputs: dict[str, str] | None = None  # {"file": path as given, "sha256": ...}: the user's input file
    golden: dict[str, str] | None = None  # the same for a golden file
    reference: str = "eager"
    shapes: list[dict[str, int]] = field(default_factory=list)  # the dimension sizes that were run

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def recipe_of(
    *,
    seed: int = 0,
    samples: int | None = None,
    batch_size: int | None = None,
    inputs: str | Path | None = None,
    golden: str | Path | None = None,
    reference: str = "eager",
    shapes: Sequence[Mapping[str, int]] = (),
) -> Recipe:
    """The recipe of a check run with these options (files are hashed)."""

    def hashed(path: str | Path | None) -> dict[str, str] | None:
        return None if path is None else {"file": str(path), "sha256": sha256_file(path)}

    return Recipe(seed, samples, batch_size, hashed(inputs), hashed(golden), reference, [dict(s) for s in shapes])


RECIPE_OPTIONS = ("seed", "samples", "batch_size", "reference")  # the options a recipe fixes (besides files)


def resolve_recipe(recorded: Recipe, given: Mapping[str, Any], *, where: str = "--baseline") -> dict[str, Any]:
    """The check options that repeat ``recorded``: seed, samples, batch size, reference, inputs and golden files.

    ``given`` holds the options the user set explicitly (by name, ``inputs``/``golden`` as paths);
    one that contradicts the recipe is refused, a file is found where the recipe names it unless
    given, and its hash must match.
    """
    options: dict[str, Any] = {}
    for name in RECIPE_OPTIONS:
        want = getattr(recorded, name)
        if name in given and given[name] is not None and given[name] != want:
            flag = "--" + name.replace("_", "-")
            raise UsageError(
                f"{where}: recorded with {flag} {want}, this run asks for {flag} {given[name]}: "
                "drop the option or record a new baseline"
            )
        options[name] = want
    for name in ("inputs", "golden"):
        entry = getattr(recorded, name)
        path = given.get(name)
        if entry is None:
            if path is not None:
                raise UsageError(f"{where}: recorded without --{name}, this run gives --{name} {path}")
            options[name] = None
            continue
        path = Path(path if path is not None else entry["file"])
        if not path.is_file():
            raise UsageError(
                f"{where}: recorded with --{name} {entry['file']}; pass that file (sha256 {entry['sha256'][:12]}…)"
            )
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise UsageError(
                f"{where}: --{name} {path} has sha256 {digest[:12]}…, the baseline's inputs had {entry['sha256'][:12]}…"
            )
        options[name] = path
    return options


# ---------------------------------------------------------------- files


def _write(path: str | Path, kind: str, body: dict[str, Any]) -> None:
    created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    atomic_write_json(path, {"format": FORMAT, "kind": kind, "version": VERSION, "created": created, **body})


def _read(path: str | Path, kind: str) -> dict[str, Any]:
    """The file's JSON object after its envelope is checked; any problem is one ``UsageError`` line."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"baseline {path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UsageError(f"baseline {path}: not a readable JSON file ({first_line(exc)})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f'baseline {path}: not a tk baseline (no "format": "{FORMAT}")')
    if data.get("kind") != kind:
        raise UsageError(f"baseline {path}: a {_shown(data.get('kind'))} baseline, expected a {kind} one")
    version = data.get("version")
    if not isinstance(version, int) or version > VERSION or version < 1:
        raise UsageError(f"baseline {path}: version {_shown(version)}, this tk reads version {VERSION}")
    return data


def _shown(value: Any) -> str:
    """A value of a damaged file as an error line quotes it: short, and never a failure of its own
    (``repr`` of an integer of 5,000 digits raises)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an {type(value).__name__} too large to show"
    return text if len(text) <= 60 else text[:57] + "..."


def _require(ok: bool, path: str | Path, what: str) -> None:
    if not ok:
        raise UsageError(f"baseline {path}: damaged ({what})")


def _is_number(value: Any) -> bool:
    """A finite JSON number (Python's json reads NaN and Infinity, which would make every limit pass or fail)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_sizes(value: Any) -> bool:
    return isinstance(value, dict) and all(_is_name(k) and _is_count(v) for k, v in value.items())


def _is_name(value: Any) -> bool:
    """A name a baseline may hold (an output, a dimension, a CPU flag, a file): printable text, which
    no control character, escape sequence or lone surrogate is."""
    return isinstance(value, str) and bool(value) and value.isprintable()


def _is_choice(value: Any, choices: Sequence[str]) -> bool:
    return isinstance(value, str) and value in choices


@dataclass
class AccuracyBaseline:
    recipe: Recipe
    engines: dict[str, dict[str, dict[str, float | None]]]  # engine -> output -> figure -> value (+ atol)
    artifact: dict[str, Any] = field(default_factory=dict)  # model, precision (for people)
    created: str = ""


def output_figures(out: Any, atol: float) -> dict[str, float | None]:
    """An ``OutputParity``'s figures as a baseline stores them (an exact match's SQNR is None; top-1 in percent)."""
    figures: dict[str, float | None] = {
        "max_abs": out.max_abs,
        "sqnr_db": None if math.isinf(out.sqnr_db) and out.sqnr_db > 0 else out.sqnr_db,
        "cosine": out.cosine,
    }
    if out.top1_rate is not None:
        figures["top1"] = 100 * out.top1_rate
    figures["atol"] = atol
    return figures


def report_figures(report: ParityReport) -> dict[str, dict[str, float | None]]:
    return {
        o.name: output_figures(o, report.tolerances.get(o.name, (report.rtol, report.atol))[1])
        for o in report.outputs
        if o.shape is not None
    }


def accuracy_baseline(
    result: CheckResult, recipe: Recipe, artifact: Mapping[str, Any] | None = None
) -> AccuracyBaseline:
    return AccuracyBaseline(recipe, {e: report_figures(r) for e, r in result.reports.items()}, dict(artifact or {}))


def save_accuracy_baseline(path: str | Path, baseline: AccuracyBaseline) -> None:
    """Write the baseline atomically (JSON; non-finite numbers are written as null)."""
    engines = {
        e: {o: {k: _finite(v) for k, v in f.items()} for o, f in outs.items()} for e, outs in baseline.engines.items()
    }
    _write(path, ACCURACY, {"artifact": baseline.artifact, "recipe": baseline.recipe.to_json(), "engines": engines})


def load_accuracy_baseline(path: str | Path) -> AccuracyBaseline:
    data = _read(path, ACCURACY)
    recipe, engines, artifact = data.get("recipe"), data.get("engines"), data.get("artifact") or {}
    _check_recipe(recipe, path)
    _require(isinstance(artifact, dict), path, "artifact is not an object")
    for engine, outputs in _engine_entries(engines, path, "outputs"):
        for output, figures in outputs.items():
            _require(_is_name(output), path, f"{engine} output {_shown(output)} is not a printable name")
            _require(isinstance(figures, dict), path, f"{engine} {output} is not an object")
            for figure, value in figures.items():
                _require(figure in (*FIGURES, "atol"), path, f"{engine} {output} figure {_shown(figure)} is unknown")
                _require(value is None or _is_number(value), path, f"{engine} {output} {figure} is not a finite number")
    known = {f.name for f in fields(Recipe)}
    return AccuracyBaseline(
        Recipe(**{k: v for k, v in recipe.items() if k in known}), engines, artifact, str(data.get("created", ""))
    )


def _engine_entries(engines: Any, path: str | Path, holds: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each engine of a baseline's ``engines`` and what it holds (``holds``: outputs, batch sizes), each
    checked to be one of tk's engines with a non-empty object."""
    _require(isinstance(engines, dict) and bool(engines), path, "no engines")
    for engine, entries in engines.items():
        _require(_is_choice(engine, ENGINES), path, f"engine {_shown(engine)} is not one of tk's engines")
        _require(isinstance(entries, dict) and bool(entries), path, f"engine {engine} has no {holds}")
        yield engine, entries


def _check_recipe(recipe: Any, path: str | Path) -> None:
    """A recipe's fields as a check takes them (``UsageError``, one line, for the first that is not)."""
    _require(isinstance(recipe, dict) and _is_seed(recipe.get("seed")), path, f"recipe seed is not 0 to {MAX_SEED}")
    _require(
        isinstance(recipe.get("shapes", []), list) and all(_is_sizes(s) for s in recipe.get("shapes", [])),
        path,
        "recipe shapes are not a list of dimension sizes",
    )
    for name in ("samples", "batch_size"):
        _require(recipe.get(name) is None or _is_count(recipe.get(name)), path, f"recipe {name} is not a count")
    _require(_is_choice(recipe.get("reference", "eager"), ENGINES), path, "recipe reference is not one of tk's engines")
    for name in ("inputs", "golden"):
        entry = recipe.get(name)
        _require(
            entry is None
            or (isinstance(entry, dict) and _is_name(entry.get("file")) and _is_sha256(entry.get("sha256"))),
            path,
            f"recipe {name} without a file name and a sha256",
        )


def _is_seed(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEED


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


# ---------------------------------------------------------------- accuracy verdicts


def accuracy_gate(
    result: CheckResult,
    baseline: AccuracyBaseline | None = None,
    margins: Margins | None = None,
    *,
    allow_missing: bool = False,
) -> Gate:
    """Per engine × output: the check's own pass/fail (``parity``) and each figure, against ``baseline`` if given.

    The run's shapes must be the baseline recipe's (else ``UsageError``): figures on other inputs
    are not comparable. An engine or output of the baseline that this run did not check (left out
    as untrusted or unavailable, not asked for, gone from the artifact) fails: a gate passes what
    it judged, never what it could not run. ``allow_missing`` turns those into skips.
    """
    margins = margins or Margins()
    gate = Gate("check", judged=baseline is not None)
    if baseline is not None and baseline.recipe.shapes:
        shapes = next(iter(result.reports.values())).shapes if result.reports else []
        if [dict(s) for s in shapes] != baseline.recipe.shapes:
            raise UsageError(
                f"--baseline: its inputs were at sizes {baseline.recipe.shapes}, this run's at {shapes}: "
                "the artifact's dimensions differ from the baseline's"
            )
    for engine, report in result.reports.items():
        recorded = baseline.engines.get(engine) if baseline is not None else None
        if baseline is not None and recorded is None:
            gate.verdicts.append(
                Verdict("check", engine, "*", "run", status="skip", message=f"{engine}: no baseline for this engine")
            )
        now = report_figures(report)
        for out in report.outputs:
            ok = out.passed
            gate.verdicts.append(
                Verdict(
                    "check", engine, out.name, "parity", 1.0 if ok else 0.0, status="pass" if ok else "fail",
                    message=f"{engine} {out.name}: parity {'passed' if ok else 'failed: ' + str(out.problem)}",
                )
            )  # fmt: skip
            if out.name not in now:
                continue
            base = recorded.get(out.name, {}) if recorded is not None else None
            for figure in FIGURES:
                if figure not in now[out.name]:
                    continue
                if figures_measured(out):
                    gate.verdicts.append(_judge_figure(engine, out.name, figure, now[out.name], base, margins))
                else:  # the comparison stopped before any figure: its defaults (0, inf, 1) are no measurement
                    gate.verdicts.append(
                        Verdict("check", engine, out.name, figure, None, status="fail",
                                baseline=(base or {}).get(figure),
                                message=f"{engine} {out.name} {figure}: not measured ({out.problem})")
                    )  # fmt: skip
        if report.batch_invariance is not None:
            bi = report.batch_invariance
            gate.verdicts.append(
                Verdict("check", engine, "batch invariance", "parity", 1.0 if bi.passed else 0.0,
                        status="pass" if bi.passed else "fail",
                        message=f"{engine} batch invariance: {'passed' if bi.passed else bi.problem}")
            )  # fmt: skip
        if recorded is not None:
            for name in recorded:
                if name not in now:
                    gate.verdicts.append(
                        missing_verdict("check", engine, name, f"{engine} {name}: in the baseline, missing from this run",
                                        allow_missing)
                    )  # fmt: skip
    if baseline is not None:
        for engine in baseline.engines:
            if engine not in result.reports:
                why = f"{engine}: in the baseline, not run here (untrusted, unavailable here, or not in --engine)"
                gate.verdicts.append(missing_verdict("check", engine, "*", why, allow_missing))
        if not any(v.baseline is not None for v in gate.verdicts):
            ran = ", ".join(result.reports) or "none"
            _nothing_compared(gate, f"the baseline holds engines {', '.join(baseline.engines)}, this run ran {ran}")
    return gate


def missing_verdict(suite: str, engine: str, item: str, why: str, allow_missing: bool) -> Verdict:
    """A row of the baseline that this run has no figure for: a failure, or with ``allow_missing`` a skip."""
    if allow_missing:
        return Verdict(suite, engine, item, "run", status="skip", message=f"{why}; accepted (--allow-missing)")
    return Verdict(
        suite, engine, item, "run", status="fail", message=f"{why}; run it, or accept its absence with --allow-missing"
    )


def _nothing_compared(gate: Gate, why: str) -> None:
    """A baseline given and nothing it holds run: one failing case for the JUnit file, and the line
    ``Gate.unmatched`` that the command ends with (exit 2: a setup to fix, not a regression)."""
    gate.unmatched = f"--baseline: nothing was compared ({why}); run what the baseline holds or record a new one"
    gate.verdicts.append(Verdict(gate.suite, "*", "*", "baseline", status="fail", message=gate.unmatched))


def _judge_figure(
    engine: str,
    output: str,
    figure: str,
    now: Mapping[str, float | None],
    base: Mapping[str, float | None] | None,
    margins: Margins,
) -> Verdict:
    value = now.get(figure)
    verdict = Verdict("check", engine, output, figure, value)
    label = f"{engine} {output} {figure}"
    if base is None or figure not in base:
        verdict.message = f"{label} {_num(value, figure)} (no baseline)"
        if base is not None:
            verdict.status = "skip"
        return verdict
    before = base[figure]
    verdict.baseline = before
    if figure == "max_abs":
        atol = margins.max_abs_atol if margins.max_abs_atol is not None else (base.get("atol") or 0.0)
        verdict.limit = margins.max_abs * (before or 0.0) + atol
        verdict.margin = f"×{margins.max_abs:g} + {atol:g}"
        failed = value is None or value > verdict.limit
        word = "above"
    elif figure == "sqnr_db":
        verdict.limit = min(SQNR_CAP_DB if before is None else before, SQNR_CAP_DB) - margins.sqnr_db
        verdict.margin = f"-{margins.sqnr_db:g} dB"
        failed = value is not None and value < verdict.limit  # None: an exact match
        word = "below"
    else:
        step = margins.cosine if figure == "cosine" else margins.top1
        verdict.limit = (before if before is not None else 0.0) - step
        verdict.margin = f"-{step:g}" + (" points" if figure == "top1" else "")
        failed = value is None or value < verdict.limit
        word = "below"
    verdict.status = "fail" if failed else "pass"
    verdict.message = (
        f"{label} {_num(value, figure)} {word if failed else 'within'} the baseline's "
        f"{_num(before, figure)} {verdict.margin} = {_num(verdict.limit, figure)}"
    )
    return verdict


def _num(value: float | None, figure: str) -> str:
    if value is None:
        return "inf" if figure == "sqnr_db" else "—"
    if figure == "sqnr_db":
        return f"{value:.1f} dB"
    if figure == "top1":
        return f"{value:.1f}%"
    if figure == "cosine":
        return f"{value:.6f}"
    if figure == "speedup":
        return f"{value:.2f}×"
    return f"{value:.3g}"


# ---------------------------------------------------------------- speed


@dataclass
class SpeedBaseline:
    machine: dict[str, Any]  # cpu, cpu_flags, cores, torch_threads
    settings: dict[str, Any]  # batch_sizes, sizes, io
    engines: dict[str, dict[str, float]]  # engine -> batch size (text) -> speed-up over eager
    created: str = ""


def cpu_identity(machine: Mapping[str, Any]) -> dict[str, Any]:
    """The CPU model and its speed flags (from the machine description, else read here)."""
    flags = machine.get("cpu_flags")
    if flags is None:
        from tk.formats.aoti import cpu_flags

        flags = sorted(f for f in cpu_flags() if f.startswith(SPEED_FLAG_PREFIXES))
    return {"cpu": machine.get("cpu"), "cpu_flags": list(flags)}


def speed_baseline(report: BenchReport) -> SpeedBaseline:
    """Each engine's speed-up over eager in ``report`` (eager itself and rows without eager are left out)."""
    engines: dict[str, dict[str, float]] = {}
    for row in report.rows:
        if row.engine != "eager" and row.speedup is not None and math.isfinite(row.speedup):
            engines.setdefault(row.engine, {})[str(row.batch_size)] = row.speedup
    if not engines:
        raise UsageError(
            "--save-baseline: no speed-up over eager to record; bench with eager (--baselines) and another engine"
        )
    machine = {
        **cpu_identity(report.machine),
        "cores": report.machine.get("usable_cores"),
        "torch_threads": report.machine.get("torch_threads"),
    }
    settings = {k: report.settings.get(k) for k in ("batch_sizes", "sizes", "io")}
    settings["eager_precision"] = _eager_precision(report)
    return SpeedBaseline(machine, settings, engines)


def _eager_precision(report: BenchReport) -> str | None:
    """The precision eager ran in (the artifact's unless set: a bf16 artifact's eager runs under bf16 autocast)."""
    engines = report.settings.get("engines")
    eager = engines.get("eager") if isinstance(engines, dict) else None
    return eager.get("precision") if isinstance(eager, dict) else None


def save_speed_baseline(path: str | Path, baseline: SpeedBaseline) -> None:
    _write(
        path,
        SPEED,
        {"machine": baseline.machine, "settings": baseline.settings, "reference": "eager", "engines": baseline.engines},
    )


def load_speed_baseline(path: str | Path) -> SpeedBaseline:
    data = _read(path, SPEED)
    machine, settings, engines = data.get("machine"), data.get("settings"), data.get("engines")
    _require(isinstance(machine, dict) and _is_name(machine.get("cpu")), path, "no machine.cpu")
    flags = machine.get("cpu_flags", [])
    _require(
        isinstance(flags, list) and all(_is_name(f) for f in flags), path, "machine.cpu_flags is not a list of names"
    )
    _check_settings(settings, path)
    for engine, rows in _engine_entries(engines, path, "batch sizes"):
        for batch, value in rows.items():
            _require(_is_batch_key(batch), path, f"{engine} batch size {_shown(batch)} is not an integer")
            _require(
                _is_number(value) and value > 0,
                path,
                f"{engine} batch {batch} speed-up {_shown(value)} is not a positive number",
            )
    return SpeedBaseline(machine, settings, engines, str(data.get("created", "")))


def _check_settings(settings: Any, path: str | Path) -> None:
    """A speed baseline's settings as tk bench takes them (``UsageError``, one line, for the first that is not)."""
    _require(isinstance(settings, dict), path, "no settings")
    batch_sizes, sizes = settings.get("batch_sizes"), settings.get("sizes")
    _require(
        batch_sizes is None or (isinstance(batch_sizes, list) and all(_is_count(b) for b in batch_sizes)),
        path,
        "settings.batch_sizes is not a list of batch sizes",
    )
    _require(sizes is None or _is_sizes(sizes), path, "settings.sizes is not an object of dimension sizes")
    for name, choices in (("io", IO_MODES), ("eager_precision", PRECISIONS)):
        value = settings.get(name)
        _require(
            value is None or _is_choice(value, choices), path, f"settings.{name} is not one of {', '.join(choices)}"
        )


def _is_batch_key(value: str) -> bool:
    """A batch size as a JSON key: ASCII digits without a leading zero (``str(int)`` of a count)."""
    return value.isascii() and value.isdigit() and not value.startswith("0") and len(value) <= 18


def refuse_other_cpu(
    baseline: SpeedBaseline, machine: Mapping[str, Any], *, any_cpu: bool = False, where: str = "--baseline"
) -> str | None:
    """One ``UsageError`` line when ``baseline`` was measured on another CPU (model or speed flags),
    unless ``any_cpu``: then a note to print, as when the CPU is the same (None)."""
    here = cpu_identity(machine)
    then = {"cpu": baseline.machine.get("cpu"), "cpu_flags": list(baseline.machine.get("cpu_flags", []))}
    if here == then:
        return None
    gained = sorted(set(here["cpu_flags"]) - set(then["cpu_flags"]))
    lost = sorted(set(then["cpu_flags"]) - set(here["cpu_flags"]))
    flags = ", ".join([*(f"+{f}" for f in gained), *(f"-{f}" for f in lost)])
    flags = f" (flags {flags})" if flags else ""
    if not any_cpu:
        raise UsageError(
            f"{where}: measured on {then['cpu']!r}, this is {here['cpu']!r}{flags}: "
            "speed ratios do not travel between CPUs; record a baseline here or pass --any-cpu"
        )
    return f"baseline from another CPU ({then['cpu']}{flags}), judged anyway (--any-cpu)"


def busy_reason(report: BenchReport) -> dict[int, str]:
    """Batch sizes whose rows the load guard marked busy (``tk.measure.load_guard``), with the readings."""
    reasons: dict[int, str] = {}
    cores = report.machine.get("cores")
    for row in report.rows:
        if row.busy:
            others = f"; other processes kept {row.others_cores:.2f} cores busy" if row.others_cores is not None else ""
            reasons[row.batch_size] = (
                f"1-minute load average {row.load_before} before, {row.load_after} after timing, on {cores} cores"
                + others
            )
    return reasons


def check_max_slowdown(pct: float) -> None:
    if not (math.isfinite(pct) and 0 <= pct < 100):
        raise UsageError(f"--max-slowdown: expected a percentage from 0 to below 100, got {pct:g}")


def speed_gate(
    report: BenchReport,
    baseline: SpeedBaseline | None = None,
    *,
    max_slowdown_pct: float = DEFAULT_MAX_SLOWDOWN_PCT,
    any_cpu: bool = False,
    where: str = "--baseline",
    allow_missing: bool = False,
) -> Gate:
    """Per engine × batch size: the speed-up over eager, judged against ``baseline`` unless the machine was busy.

    A baseline from another CPU (model or speed flags) is refused with one ``UsageError`` line
    unless ``any_cpu``; so is one measured at other sizes or another ``io`` mode. A busy machine's
    rows are reported and skipped, not judged. A baseline row not measured here fails, unless
    ``allow_missing``.
    """
    check_max_slowdown(max_slowdown_pct)
    gate = Gate("bench", judged=baseline is not None)
    busy = busy_reason(report)
    if baseline is not None:
        note = refuse_other_cpu(baseline, report.machine, any_cpu=any_cpu, where=where)
        if note:
            gate.notes.append(note)
        for key in ("sizes", "io"):
            then_value, now_value = baseline.settings.get(key), report.settings.get(key)
            if then_value is not None and now_value is not None and then_value != now_value:
                raise UsageError(
                    f"{where}: measured with {key} {then_value}, this run with {now_value}: not comparable"
                )
    if baseline is not None:
        then_precision, now_precision = baseline.settings.get("eager_precision"), _eager_precision(report)
        if then_precision and now_precision and then_precision != now_precision:
            gate.notes.append(
                f"speed-ups are over eager in {now_precision} here, in {then_precision} in the baseline: "
                "compare artifacts of one precision"
            )
    for why in dict.fromkeys(busy.values()):
        batches = ", ".join(str(b) for b, w in sorted(busy.items()) if w == why)
        gate.notes.append(f"busy machine, not judged (batch {batches}): {why}")
    seen: set[tuple[str, str]] = set()
    keep = 1 - max_slowdown_pct / 100
    for row in report.rows:
        if row.engine == "eager":
            continue
        item, batch = f"batch {row.batch_size}", str(row.batch_size)
        seen.add((row.engine, batch))
        verdict = Verdict("bench", row.engine, item, "speedup", row.speedup)
        label = f"{row.engine} {item} speed-up"
        before = baseline.engines.get(row.engine, {}).get(batch) if baseline is not None else None
        if row.speedup is None:
            verdict.status, verdict.message = "skip", f"{label}: no eager row to compare with"
        elif baseline is None:
            verdict.message = f"{label} {row.speedup:.2f}×"
        elif before is None:
            verdict.status, verdict.message = "skip", f"{label} {row.speedup:.2f}× (no baseline)"
        else:
            verdict.baseline, verdict.limit, verdict.margin = before, before * keep, f"-{max_slowdown_pct:g}%"
            if row.batch_size in busy:
                verdict.status = "skip"
                verdict.message = f"{label} {row.speedup:.2f}× vs {before:.2f}×: busy machine, not judged"
            else:
                failed = row.speedup < verdict.limit
                verdict.status = "fail" if failed else "pass"
                verdict.message = (
                    f"{label} {row.speedup:.2f}× {'below' if failed else 'within'} the baseline's "
                    f"{before:.2f}× -{max_slowdown_pct:g}% = {verdict.limit:.2f}×"
                )
        gate.verdicts.append(verdict)
    if baseline is not None:
        for engine, rows in baseline.engines.items():
            for batch in rows:
                if (engine, batch) not in seen:
                    why = f"{engine} batch {batch}: in the baseline, not measured here"
                    verdict = missing_verdict("bench", engine, f"batch {batch}", why, allow_missing)
                    verdict.figure, verdict.baseline = "speedup", rows[batch]
                    gate.verdicts.append(verdict)
        if not any(v.limit is not None for v in gate.verdicts):  # busy rows count: they were compared, not judged
            held = "; ".join(f"{e} at batch {', '.join(rows)}" for e, rows in baseline.engines.items())
            ran = "; ".join(f"{e} at batch {b}" for e, b in sorted(seen)) or "nothing besides eager"
            _nothing_compared(gate, f"the baseline holds {held}, this run measured {ran}")
    return gate


# ---------------------------------------------------------------- table


def render_gate(gate: Gate, title: str | None = None) -> Table:
    """Before/after: one row per verdict that has a baseline or failed."""
    from rich.table import Table

    from tk.text import table_cell

    table = Table(title=table_cell(title or f"{gate.suite} against the baseline"))
    for column in (
        "engine",
        "output" if gate.suite == "check" else "batch",
        "figure",
        "baseline",
        "now",
        "limit",
        "result",
    ):
        table.add_column(
            column, justify="left" if column in ("engine", "output", "batch", "figure", "result") else "right"
        )
    for v in gate.verdicts:
        if v.limit is None and v.status == "pass":  # not judged against a baseline
            continue
        names = (table_cell(v.engine), table_cell(v.item), table_cell(v.figure))  # a baseline file's names
        if v.figure == "run":
            table.add_row(*names, "", "", "", table_cell(f"{v.status}: {v.message}"))
            continue
        if v.figure == "parity":
            if v.failed:
                table.add_row(*names, "", "", "", table_cell(f"FAIL: {v.message}"))
            continue
        result = {"pass": "pass", "fail": "FAIL", "skip": "skip"}[v.status]
        table.add_row(
            *names, _num(v.baseline, v.figure), _num(v.value, v.figure),
            f"{_num(v.limit, v.figure)} ({v.margin})" if v.limit is not None else "", result,
        )  # fmt: skip
    if gate.notes:
        table.caption = "\n".join(table_cell(note) for note in gate.notes)
    return table
