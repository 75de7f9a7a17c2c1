"""``tk optimize`` for decoders: the fastest artifact whose greedy tokens keep to PyTorch's, chosen here.

A decoder is judged by what it generates and timed generating, not by one call: each candidate (a
format at a precision, weight-only int8 and int4 among them: ``--int8-mode weights``) is exported,
then generates greedily from held-out prompts (other prompts than its export check's) beside the eager
float32 model; it passes when the share of tokens it reproduces before each row's first difference
(``agreement``) is at least ``--accuracy agreement>=X`` (0.99 by default). Its per-step logit error is
in the table. Candidates that pass are timed decoding at batch 1 in interleaved rounds, with the bytes a
step reads over its time as a share of this machine's copy bandwidth (decode at batch 1 is bound by
memory bandwidth: weight-only quantization earns its speed by reading fewer bytes), and the fastest is
written as an ordinary artifact whose manifest records the table.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tk.errors import ParityError, TkError, UsageError, first_line
from tk.export import ExportOptions
from tk.manifest import Manifest, read_manifest
from tk.measure.generation import GenerationRun, copy_bandwidth
from tk.measure.timing import interleave
from tk.models import ModelSpec
from tk.runtime import load
from tk.runtime.generation import CacheLayout, Generated
from tk.tolerances import artifact_tolerance
from tk.workflows.generation_check import check_generation, parity_prompts
from tk.workflows.optimize.artifacts import refuse_foreign_out, write_winner
from tk.workflows.optimize.candidates import Candidate, writer_of

# (format, precision, --int8-mode): float32 first, the baseline the speed-ups are against
CANDIDATES: tuple[tuple[str, str, str | None], ...] = (
    ("onnx", "fp32", None),
    ("openvino", "fp32", None),
    ("openvino", "bf16", None),
    ("onnx", "int8", "weights"),
    ("openvino", "int8", "weights"),
    ("onnx", "int8", "weights-int4"),
    ("openvino", "int8", "weights-int4"),
)
BITS = {None: 32, "weights": 8, "weights-int4": 4}  # bits a product's weight takes (bf16: 16)
DEFAULT_AGREEMENT = 0.99
# int4's per-output bar, recorded in its manifest for tk check: the judge here (greedy agreement) is what decides
SQNR_FLOOR_INT4 = 10.0
ATOL_INT4 = 2.0


@dataclass
class DecoderOptimizeOptions:
    accuracy: str | None = None  # agreement>=X; default 0.99
    checkpoint: Path | None = None
    formats: tuple[str, ...] | None = None
    precisions: tuple[str, ...] | None = None
    prompts: int = 16  # held-out prompts the judge generates from
    new_tokens: int = 32  # per prompt, judged and timed
    rounds: int = 5  # interleaved timing rounds
    force: bool = False


@dataclass
class DecoderRow:
    candidate: str
    format: str
    precision: str
    int8_mode: str | None
    agreement: float | None = None
    max_logit_error: float | None = None
    task_accuracy: float | None = None  # the built-in decoder: tokens that follow its rule
    first_difference: str | None = None
    rtol: float | None = None  # the logit tolerance its precision is held to (recorded with the judge's report)
    atol: float | None = None
    decode_ms: float | None = None  # median decode step at batch 1
    ttft_ms: float | None = None
    bytes_per_step: int | None = None
    bandwidth_share: float | None = None
    speedup: float | None = None  # against the first float32 candidate's decode step
    passed: bool = False
    note: str = ""  # why it was skipped or failed

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DecoderOptimizeResult:
    rows: list[DecoderRow]
    winner: DecoderRow
    record: dict[str, Any] = field(default_factory=dict)


def parse_agreement(text: str | None) -> float:
    """``agreement>=X`` (X in (0, 1]) -> X; None -> the default."""
    if text is None:
        return DEFAULT_AGREEMENT
    match = re.fullmatch(r"\s*agreement\s*>=\s*([0-9]*\.?[0-9]+)\s*", text)
    if match is None or not 0 < float(match.group(1)) <= 1:
        raise UsageError(
            f"--accuracy: a decoder is judged by greedy-token agreement; expected agreement>=X with X in (0, 1] "
            f"(default agreement>={DEFAULT_AGREEMENT}), got {text!r}"
        )
    return float(match.group(1))


def optimize_decoder(
    spec: ModelSpec, out: str | Path, options: DecoderOptimizeOptions, say: Callable[[str], None] = lambda _: None
) -> DecoderOptimizeResult:
    """Export, judge and time every decoder candidate; write the fastest that keeps the agreement to ``out``.
    Raises ``ParityError`` (the table in ``err.result``) when none keeps it."""
    from tk.models.checkpoint import require_checkpoint_fits

    out = Path(out)
    floor = parse_agreement(options.accuracy)
    refuse_foreign_out(out, force=options.force)
    if options.checkpoint is not None:  # before any candidate: every export would fail on it alike
        require_checkpoint_fits(spec.module, options.checkpoint)
    rows = [_row(fmt, precision, mode) for fmt, precision, mode in CANDIDATES if _wanted(fmt, precision, options)]
    if not rows:
        raise UsageError("tk optimize: --formats and --precisions leave no decoder candidate (onnx, openvino; "
                         "fp32, bf16, int8)")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="tk-optimize-decoder-"))
    try:
        roots = _export_all(spec, rows, work, options, say)
        _judge_all(rows, roots, floor, options, say)
        bandwidth = _time_all(rows, roots, options, say)
        passed = [r for r in rows if r.passed and r.decode_ms is not None]
        record = {"accuracy": f"agreement>={floor}", "rows": [r.to_json() for r in rows],
                  "bandwidth_bytes_per_s": bandwidth}  # fmt: skip
        if not passed:
            error = ParityError(f"tk optimize: no decoder candidate kept agreement>={floor}: " + "; ".join(
                f"{r.candidate}: {r.note or f'agreement {r.agreement:.1%}'}" for r in rows))  # fmt: skip
            error.result = DecoderOptimizeResult(rows, rows[0], record)  # type: ignore[attr-defined]
            raise error
        winner = min(passed, key=lambda r: r.decode_ms or float("inf"))
        record["winner"] = winner.candidate
        _write(out, roots[winner.candidate], winner, record, options, work)
        return DecoderOptimizeResult(rows, winner, record)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _row(fmt: str, precision: str, mode: str | None) -> DecoderRow:
    return DecoderRow(_candidate(fmt, precision, mode).name, fmt, precision, mode)


def _candidate(fmt: str, precision: str, mode: str | None) -> Candidate:
    options = writer_of(fmt).Options(int8_mode=mode) if mode else None
    return Candidate(fmt, precision, fmt, options)


def _wanted(fmt: str, precision: str, options: DecoderOptimizeOptions) -> bool:
    return (options.formats is None or fmt in options.formats) and (
        options.precisions is None or precision in options.precisions
    )


def _export_all(spec: ModelSpec, rows: list[DecoderRow], work: Path, options: DecoderOptimizeOptions,
                say: Callable[[str], None]) -> dict[str, Path]:  # fmt: skip
    """Each candidate exported alone (unchecked: the judge here decides), into ``work``; skipped ones noted."""
    from tk.workflows.export import export

    roots: dict[str, Path] = {}
    for index, row in enumerate(rows):
        writer = writer_of(row.format)
        reason = writer.unavailable_reason("cpu", row.precision)
        if reason is not None:
            row.note = f"skipped: {reason}"
            continue
        say(f"export {row.candidate} ({index + 1}/{len(rows)})")
        candidate = _candidate(row.format, row.precision, row.int8_mode)
        export_options = ExportOptions(
            formats=(row.format,), precision=row.precision, checkpoint=options.checkpoint, check=False,
            settings={row.format: candidate.options} if candidate.options is not None else {},
            min_sqnr_db=SQNR_FLOOR_INT4 if row.int8_mode == "weights-int4" else None,
            atol=ATOL_INT4 if row.int8_mode == "weights-int4" else None,
        )  # fmt: skip
        root = work / f"candidate-{index}"
        try:
            export(spec, root, export_options)
        except TkError as exc:
            row.note = f"export failed: {first_line(exc)}"
            continue
        roots[row.candidate] = root
    return roots


def _held_out(manifest: Manifest, count: int, new_tokens: int) -> tuple[list[list[int]], int]:
    """Prompts the export check did not use (another seed), cut to leave room for the new tokens."""
    slots = CacheLayout.from_generation(manifest.generation).slots
    new_tokens = max(2, min(new_tokens, slots // 2))
    prompts = parity_prompts(manifest, count=count, seed=1)
    return [p[: slots - new_tokens] for p in prompts], new_tokens


def _judge_all(rows: list[DecoderRow], roots: dict[str, Path], floor: float, options: DecoderOptimizeOptions,
               say: Callable[[str], None]) -> None:  # fmt: skip
    if not roots:
        return
    first = read_manifest(next(iter(roots.values())))
    prompts, new_tokens = _held_out(first, options.prompts, options.new_tokens)
    with load(next(iter(roots.values())), engine="eager") as reference:
        largest = reference.dims["batch"].max
        for row in rows:
            if row.candidate not in roots:
                continue
            say(f"judge {row.candidate}: greedy tokens on {len(prompts)} held-out prompts")
            with load(roots[row.candidate], engine=row.format) as engine:
                rtol, atol, _ = artifact_tolerance(engine.manifest.precision, engine.manifest.model)
                reports = [
                    check_generation(reference, engine, prompts[i : i + largest], rtol=rtol, atol=atol,
                                     new_tokens=new_tokens)
                    for i in range(0, len(prompts), largest)
                ]  # fmt: skip
            weights = [r.prompts for r in reports]
            row.rtol, row.atol = rtol, atol
            row.agreement = sum(r.agreement * w for r, w in zip(reports, weights, strict=True)) / sum(weights)
            row.max_logit_error = max(r.max_logit_error for r in reports)
            accuracies = [r.task_accuracy for r in reports if r.task_accuracy is not None]
            row.task_accuracy = sum(accuracies) / len(accuracies) if accuracies else None
            differing = [r for r in reports if r.divergence is not None]
            row.first_difference = differing[0].summary() if differing else None
            row.passed = row.agreement >= floor
            if not row.passed:
                row.note = f"agreement {row.agreement:.1%} < {floor:.1%}"


def _time_all(rows: list[DecoderRow], roots: dict[str, Path], options: DecoderOptimizeOptions,
              say: Callable[[str], None]) -> float | None:  # fmt: skip
    """Decode at batch 1 for every candidate that passed, interleaved rounds; bytes a step reads per second
    as a share of the copy bandwidth measured here (returned, bytes/s)."""
    timed = [r for r in rows if r.passed]
    if not timed:
        return None
    say(f"time {len(timed)} candidates decoding at batch 1, {options.rounds} interleaved rounds")
    with ExitStack() as stack:
        runs: dict[str, GenerationRun] = {}
        for row in timed:
            engine = stack.enter_context(load(roots[row.candidate], engine=row.format))
            layout = CacheLayout.from_generation(engine.manifest.generation)
            prompt_len = max(1, min(engine.manifest.signature.dims["seq"].opt, layout.slots - options.new_tokens))
            prompt = [[(7 * i + 3) % int(engine.manifest.generation["vocab_size"]) for i in range(prompt_len)]]
            runs[row.candidate] = _run(engine, prompt, min(options.new_tokens, layout.slots - prompt_len))
            row.bytes_per_step = _step_bytes(roots[row.candidate], engine.manifest, row) + layout.nbytes(1)
        for run in runs.values():
            run.call()  # warm-up
        interleave({name: run.timed for name, run in runs.items()}, iters=options.rounds)
    bandwidth = copy_bandwidth()
    baseline = None
    for row in timed:
        samples = runs[row.candidate].samples[1:] or runs[row.candidate].samples
        steps = sorted(t for _, decode in samples for t in decode)
        row.decode_ms = steps[len(steps) // 2] * 1e3
        row.ttft_ms = sorted(t for t, _ in samples)[len(samples) // 2] * 1e3
        row.bandwidth_share = (row.bytes_per_step or 0) / (row.decode_ms / 1e3) / bandwidth
        baseline = baseline or (row.decode_ms if row.precision == "fp32" else None)
    for row in timed:
        row.speedup = baseline / row.decode_ms if baseline and row.decode_ms else None
    return bandwidth


def _run(engine: Any, prompts: list[list[int]], new_tokens: int) -> GenerationRun:
    def call() -> tuple[float, list[float]]:
        out: Generated = engine.generate(prompts, max_new_tokens=new_tokens, stop_ids=())
        return out.step_seconds[0], out.step_seconds[1:]

    return GenerationRun(call)


def _step_bytes(root: Path, manifest: Manifest, row: DecoderRow) -> int:
    """The weights a decode step reads: float32's weights file scaled to the candidate's bits (bf16: 16)."""
    bits = 16 if row.precision == "bf16" else BITS[row.int8_mode]
    return manifest.file("weights").size * bits // 32


def _write(out: Path, root: Path, winner: DecoderRow, record: dict[str, Any], options: DecoderOptimizeOptions,
           work: Path) -> None:  # fmt: skip
    import dataclasses

    manifest = read_manifest(root)
    judged = {k: getattr(winner, k) for k in ("agreement", "max_logit_error", "task_accuracy", "first_difference")}
    # the judge's greedy generation is this artifact's check: where the export check records a decoder's
    generation = {**manifest.generation, "check": {winner.format: {**judged, "passed": True, "held_out": True}}}
    parity = {"passed": True, "outputs": [], "shapes": [], "rtol": winner.rtol or 0.0, "atol": winner.atol or 0.0}
    checked = dataclasses.replace(manifest, check={winner.format: parity}, generation=generation)
    extras = {"optimize.json": json.dumps(record, indent=2).encode()}
    candidate = _candidate(winner.format, winner.precision, winner.int8_mode)
    write_winner(out, root, checked, candidate, judged, record, extras, [], work, force=options.force)


def render_decoder(result: DecoderOptimizeResult) -> Any:
    """The candidates as a rich table: agreement, logit error, decode speed and bandwidth share."""
    from rich.table import Table

    table = Table(title=f"tk optimize (decoder): judged by {result.record.get('accuracy', 'agreement')}")
    for column in ("candidate", "agreement", "max logit err", "rule acc", "decode ms", "x fp32", "bandwidth",
                   "result"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("candidate", "result") else "right")

    def number(value: float | None, form: str) -> str:
        return "" if value is None else format(value, form)

    for row in result.rows:
        verdict = "winner" if row is result.winner and row.passed else ("pass" if row.passed else row.note or "fail")
        table.add_row(
            row.candidate, number(row.agreement, ".1%"), number(row.max_logit_error, ".2e"),
            number(row.task_accuracy, ".1%"), number(row.decode_ms, ".2f"), number(row.speedup, ".2f"),
            number(row.bandwidth_share, ".0%"), verdict,
        )  # fmt: skip
    return table
