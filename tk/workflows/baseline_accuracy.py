"""Accuracy baselines: a ``tk check``'s figures per engine and output, and the recipe of its inputs.

``accuracy_gate`` judges a check against one (``Margins``: how far each figure may fall); the
recipe (``Recipe``, ``resolve_recipe``) makes a later check run on the same inputs. The file, the
verdicts and the table are shared with speed baselines (``tk.workflows.baseline``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tk.errors import UsageError
from tk.fileio import sha256_file
from tk.json_values import finite, is_choice, is_count, is_name, is_number, is_sha256, is_sizes, shown
from tk.parity import figures_measured
from tk.registries import ENGINES
from tk.workflows.baseline import (
    Gate,
    Verdict,
    engine_entries,
    figure_text,
    missing_verdict,
    nothing_compared,
    read_baseline,
    require_intact,
    write_baseline,
)

if TYPE_CHECKING:
    from tk.parity import ParityReport
    from tk.workflows.check import CheckResult

ACCURACY = "accuracy"  # the file's kind
SQNR_CAP_DB = 120.0  # a baseline's SQNR counts as at most this: above it, float32 rounding decides, not the artifact
FIGURES = ("max_abs", "sqnr_db", "cosine", "top1")  # accuracy figures, in table order
FIGURE_ALIASES = {"sqnr": "sqnr_db", "top1_pct": "top1", "max-abs": "max_abs"}
MAX_SEED = 2**32 - 1  # the largest seed numpy's and torch's generators take (tk check --seed)


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
        e: {o: {k: finite(v) for k, v in f.items()} for o, f in outs.items()} for e, outs in baseline.engines.items()
    }
    write_baseline(
        path, ACCURACY, {"artifact": baseline.artifact, "recipe": baseline.recipe.to_json(), "engines": engines}
    )


def load_accuracy_baseline(path: str | Path) -> AccuracyBaseline:
    data = read_baseline(path, ACCURACY)
    recipe, engines, artifact = data.get("recipe"), data.get("engines"), data.get("artifact") or {}
    _check_recipe(recipe, path)
    require_intact(isinstance(artifact, dict), path, "artifact is not an object")
    for engine, outputs in engine_entries(engines, path, "outputs"):
        for output, figures in outputs.items():
            require_intact(is_name(output), path, f"{engine} output {shown(output)} is not a printable name")
            require_intact(isinstance(figures, dict), path, f"{engine} {output} is not an object")
            for figure, value in figures.items():
                require_intact(
                    figure in (*FIGURES, "atol"), path, f"{engine} {output} figure {shown(figure)} is unknown"
                )
                require_intact(
                    value is None or is_number(value), path, f"{engine} {output} {figure} is not a finite number"
                )
    known = {f.name for f in fields(Recipe)}
    return AccuracyBaseline(
        Recipe(**{k: v for k, v in recipe.items() if k in known}), engines, artifact, str(data.get("created", ""))
    )


def _check_recipe(recipe: Any, path: str | Path) -> None:
    """A recipe's fields as a check takes them (``UsageError``, one line, for the first that is not)."""
    require_intact(
        isinstance(recipe, dict) and _is_seed(recipe.get("seed")), path, f"recipe seed is not 0 to {MAX_SEED}"
    )
    require_intact(
        isinstance(recipe.get("shapes", []), list) and all(is_sizes(s) for s in recipe.get("shapes", [])),
        path,
        "recipe shapes are not a list of dimension sizes",
    )
    for name in ("samples", "batch_size"):
        require_intact(recipe.get(name) is None or is_count(recipe.get(name)), path, f"recipe {name} is not a count")
    require_intact(
        is_choice(recipe.get("reference", "eager"), ENGINES), path, "recipe reference is not one of tk's engines"
    )
    for name in ("inputs", "golden"):
        entry = recipe.get(name)
        require_intact(
            entry is None
            or (isinstance(entry, dict) and is_name(entry.get("file")) and is_sha256(entry.get("sha256"))),
            path,
            f"recipe {name} without a file name and a sha256",
        )


def _is_seed(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEED


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
        _require_the_recipes_shapes(result, baseline)
    for engine, report in result.reports.items():
        recorded = baseline.engines.get(engine) if baseline is not None else None
        if baseline is not None and recorded is None:
            gate.verdicts.append(
                Verdict("check", engine, "*", "run", status="skip", message=f"{engine}: no baseline for this engine")
            )
        gate.verdicts.extend(_engine_verdicts(engine, report, recorded, margins, allow_missing))
    if baseline is not None:
        for engine in baseline.engines:
            if engine not in result.reports:
                why = f"{engine}: in the baseline, not run here (untrusted, unavailable here, or not in --engine)"
                gate.verdicts.append(missing_verdict("check", engine, "*", why, allow_missing))
        if not any(v.baseline is not None for v in gate.verdicts):
            ran = ", ".join(result.reports) or "none"
            nothing_compared(gate, f"the baseline holds engines {', '.join(baseline.engines)}, this run ran {ran}")
    return gate


def _require_the_recipes_shapes(result: CheckResult, baseline: AccuracyBaseline) -> None:
    shapes = next(iter(result.reports.values())).shapes if result.reports else []
    if [dict(s) for s in shapes] != baseline.recipe.shapes:
        raise UsageError(
            f"--baseline: its inputs were at sizes {baseline.recipe.shapes}, this run's at {shapes}: "
            "the artifact's dimensions differ from the baseline's"
        )


def _engine_verdicts(
    engine: str,
    report: ParityReport,
    recorded: Mapping[str, Mapping[str, float | None]] | None,
    margins: Margins,
    allow_missing: bool,
) -> list[Verdict]:
    """One engine's verdicts: per output its parity and figures, then batch invariance, then the
    outputs of its baseline (``recorded``) this run did not give."""
    verdicts = []
    now = report_figures(report)
    for out in report.outputs:
        ok = out.passed
        verdicts.append(
            Verdict(
                "check", engine, out.name, "parity", 1.0 if ok else 0.0, status="pass" if ok else "fail",
                message=f"{engine} {out.name}: parity {'passed' if ok else 'failed: ' + str(out.problem)}",
            )
        )  # fmt: skip
        if out.name in now:
            base = recorded.get(out.name, {}) if recorded is not None else None
            verdicts.extend(_figure_verdicts(engine, out, now[out.name], base, margins))
    if report.batch_invariance is not None:
        bi = report.batch_invariance
        verdicts.append(
            Verdict("check", engine, "batch invariance", "parity", 1.0 if bi.passed else 0.0,
                    status="pass" if bi.passed else "fail",
                    message=f"{engine} batch invariance: {'passed' if bi.passed else bi.problem}")
        )  # fmt: skip
    for name in recorded or ():
        if name not in now:
            why = f"{engine} {name}: in the baseline, missing from this run"
            verdicts.append(missing_verdict("check", engine, name, why, allow_missing))
    return verdicts


def _figure_verdicts(
    engine: str,
    out: Any,
    now: Mapping[str, float | None],
    base: Mapping[str, float | None] | None,
    margins: Margins,
) -> list[Verdict]:
    """The verdicts of ``out``'s (an ``OutputParity``) figures, or, where its comparison stopped before
    measuring them, one failure per figure: its defaults (0, inf, 1) are no measurement."""
    verdicts = []
    for figure in FIGURES:
        if figure not in now:
            continue
        if figures_measured(out):
            verdicts.append(_judge_figure(engine, out.name, figure, now, base, margins))
        else:
            verdicts.append(
                Verdict("check", engine, out.name, figure, None, status="fail",
                        baseline=(base or {}).get(figure),
                        message=f"{engine} {out.name} {figure}: not measured ({out.problem})")
            )  # fmt: skip
    return verdicts


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
        verdict.message = f"{label} {figure_text(value, figure)} (no baseline)"
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
        f"{label} {figure_text(value, figure)} {word if failed else 'within'} the baseline's "
        f"{figure_text(before, figure)} {verdict.margin} = {figure_text(verdict.limit, figure)}"
    )
    return verdict
