"""One architecture exported to its formats in one checked export, read back as one ``Cell`` per format."""

from __future__ import annotations

import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.model_coverage.catalog import ARCHS, Arch
from tk.errors import ParityError, PartialExportError, TkError, first_line
from tk.export import ExportOptions
from tk.manifest import MANIFEST, Manifest, read_manifest
from tk.models import build_model
from tk.spec import Dim
from tk.workflows.export import export

# each dimension the suite narrows, where a model has it: a few seconds per export on two cores
SMALL_DIMS = {
    "batch": Dim("batch", 1, 2, 4),
    "seq": Dim("seq", 1, 16, 32),
    "decoder_seq": Dim("decoder_seq", 1, 8, 16),
    "samples": Dim("samples", 400, 1600, 3200),  # wav2vec2's waveforms: 0.025 to 0.2 s at 16 kHz
}
# what a failure's line must say to name its format: the format, or the converter that writes it; every format
# is converted from torch.export's program, so a failed capture names them all
FORMAT_WORDS = {
    "torch": ("torch",),
    "onnx": ("onnx", "torch.export"),
    "openvino": ("openvino", "torch.export"),
    "aoti": ("aoti", "aotinductor", "torch.export"),
}
# what a failure's line must hold to say what to try: a flag, a command, or advice
NEXT_STEP = re.compile(r"(--[a-z]|\btry\b|\buse\b|\bexport it\b|\bpass\b|\bset\b|\binstall\b|\breport\b)", re.I)


@dataclass
class Cell:
    """One architecture in one format: what a user would see."""

    arch: str
    family: str
    source: str
    task: str | None
    format: str
    verdict: str  # passed | failed
    reason: str | None = None  # failed: one line naming the format and what to try
    fallback: str | None = None  # the converter's fallback that wrote it (manifest.formats[fmt]["fallback"])
    max_abs: float | None = None  # the check's largest max abs error over the outputs
    check: str | None = None  # the export check's verdict: passed | failed | None (it never ran)
    signal: str | None = None  # the check's note that the reference says little ("near zero", "constant")
    known: bool = False  # a failure of tk reported and listed in the catalog (Arch.known)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_arch(arch: Arch, hf_dirs: dict[str, Path], out: Path) -> list[Cell]:
    """Export ``arch`` to all its formats in one checked export at ``out``; one cell per format."""
    try:
        spec = build_model(arch.model_name(hf_dirs), task=arch.task)
        dims = {name: dim for name, dim in SMALL_DIMS.items() if name in spec.signature.dims}
        export(spec, out, ExportOptions(formats=arch.formats, dims=dims))
    except (PartialExportError, ParityError):
        pass  # the artifact holds the formats that passed; its manifest names the others
    except TkError as exc:  # nothing written: every format fails with tk's one line
        return [_cell(arch, fmt, reason=first_line(exc)) for fmt in arch.formats]
    except Exception as exc:  # not a TkError: a bug of tk, which a user would see as a traceback
        formats = ", ".join(arch.formats)
        line = f"{formats}: tk raised {type(exc).__name__} (a traceback, not one line): {first_line(exc)}"
        return [_cell(arch, fmt, reason=line) for fmt in arch.formats]
    if not (out / MANIFEST).is_file():
        return [_cell(arch, fmt, reason="no artifact was written and no error was raised") for fmt in arch.formats]
    manifest = read_manifest(out)
    return [_cell_from_manifest(arch, fmt, manifest) for fmt in arch.formats]


def _cell(arch: Arch, fmt: str, **fields: Any) -> Cell:
    fields.setdefault("verdict", "failed")
    known = fields["verdict"] == "failed" and fmt in arch.known
    if known:
        fields["reason"] = f"{arch.known[fmt]} ({fields.get('reason')})"
    return Cell(arch.name, arch.family, arch.source, arch.task, fmt, known=known, **fields)


def _cell_from_manifest(arch: Arch, fmt: str, manifest: Manifest) -> Cell:
    if fmt in manifest.failed:
        return _cell(arch, fmt, reason=manifest.failed[fmt])
    report = manifest.check.get(fmt)
    fallback = (manifest.formats.get(fmt) or {}).get("fallback")
    if report is None:
        return _cell(arch, fmt, reason=f"{fmt}: written but never checked", fallback=fallback)
    outputs = [o for o in (report["outputs"] or []) if o.get("max_abs") is not None]
    max_abs = max((float(o["max_abs"]) for o in outputs), default=None)
    signal = next((o["reference_signal"] for o in outputs if o.get("reference_signal")), None)
    check = "passed" if report["passed"] else "failed"
    figures = {"fallback": fallback, "max_abs": max_abs, "check": check, "signal": signal}
    if report["passed"]:
        return _cell(arch, fmt, verdict="passed", **figures)
    return _cell(arch, fmt, reason=f"{fmt}: the export check failed: {_check_failures(report)}", **figures)


def _check_failures(report: dict[str, Any]) -> str:
    lines = [f"{o['name']}: {o['problem']}" for o in report["outputs"] if not o["passed"]]
    probe = report.get("batch_invariance")
    if probe and not probe["passed"]:
        lines.append(f"batch invariance: {probe['problem']}")
    return "; ".join(lines)


def reason_problems(cell: Cell) -> list[str]:
    """What a failed cell's reason lacks: one line, its format named, a next step."""
    reason = cell.reason or ""
    problems = []
    if not reason or "\n" in reason:
        problems.append("not one line")
    if not any(word in reason.lower() for word in FORMAT_WORDS[cell.format]):
        problems.append(f"does not name {cell.format}")
    if not NEXT_STEP.search(reason):
        problems.append("says nothing to try")
    return problems


@dataclass
class CoverageRun:
    """Each architecture exported once, when first asked for (under ``work``), its cells kept; the artifact
    itself is removed once read (a ResNet-50 in three formats is 300 MB)."""

    work: Path
    hf_dirs: dict[str, Path]
    done: dict[str, list[Cell]] = field(default_factory=dict)

    def cells_of(self, arch: Arch) -> list[Cell]:
        if arch.name not in self.done:
            out = self.work / re.sub(r"[^A-Za-z0-9.-]+", "-", arch.name)
            self.done[arch.name] = run_arch(arch, self.hf_dirs, out)
            shutil.rmtree(out, ignore_errors=True)
        return self.done[arch.name]

    def all_cells(self, archs: tuple[Arch, ...] = ARCHS) -> list[Cell]:
        return [cell for arch in archs for cell in self.cells_of(arch)]
