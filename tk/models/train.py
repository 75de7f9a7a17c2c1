"""The standard training loop, eager or under ``torch.compile``, with what it measured."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from tk.errors import CaptureError, UsageError, first_line
from tk.models.base import ModelSpec, TrainingTask

WARMUP_STEPS = 3  # steps left out of the steady-state rate (compilation, allocator warm-up)


@dataclass(frozen=True)
class CompileOptions:
    """Options passed to ``torch.compile``; ``None`` means torch's default."""

    mode: str | None = None  # default | reduce-overhead | max-autotune
    dynamic: bool | None = None
    fullgraph: bool = False
    backend: str = "inductor"


@dataclass
class TrainResult:
    steps: int
    final_loss: float  # average training loss of the last steps
    first_loss: float
    val_loss: float
    val_accuracy: float | None
    seconds: float
    steps_per_s: float  # after the warm-up steps
    first_step_s: float  # includes compilation when compiled
    compiled: bool
    graphs: int = 0
    graph_breaks: int = 0
    recompilations: int = 0
    graph_break_reasons: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "losses"}
        return out


def resolve_device(device: str) -> torch.device:
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device: expected cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: expected a CUDA GPU, found none (torch.cuda.is_available() is False)")
    return torch.device(device)


def _dynamo_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "frames": int(counters["frames"]["ok"]),
        "breaks": int(sum(counters["graph_break"].values())),
    }


def _break_reasons() -> list[str]:
    from torch._dynamo.utils import counters

    return [first_line(Exception(reason)) for reason in counters["graph_break"]]


def _compile(module: nn.Module, options: CompileOptions) -> Callable[..., torch.Tensor]:
    kwargs: dict[str, Any] = {"fullgraph": options.fullgraph, "backend": options.backend}
    if options.mode and options.mode != "default":
        kwargs["mode"] = options.mode
    if options.dynamic is not None:
        kwargs["dynamic"] = options.dynamic
    return torch.compile(module, **kwargs)


def capture_error_from(exc: Exception) -> CaptureError:
    """One line from a Dynamo error: its cause and the user's source line when it names one."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    cause = first_line(exc)
    where = next((ln for ln in lines if ln.startswith("File ") or ("line " in ln and ".py" in ln)), "")
    message = f"graph break under --fullgraph: {cause}"
    if where:
        message += f" (at {where})"
    return CaptureError(message)


def evaluate(
    module: nn.Module, task: TrainingTask, batch: tuple[tuple[torch.Tensor, ...], torch.Tensor]
) -> tuple[float, float | None]:
    """Loss (and accuracy for classification) in eval mode; the module returns to train mode."""
    inputs, target = batch
    module.eval()
    try:
        with torch.no_grad():
            out = module(*inputs)
            loss = float(task.loss(out, target))
            acc = float((out.argmax(dim=-1) == target).float().mean()) if task.classification else None
    finally:
        module.train()
    return loss, acc


SAMPLES_SEED = 2_000_003  # added to the training seed: the held-out samples are neither trained on nor validated


def task_samples(spec: ModelSpec, count: int, *, seed: int = 0) -> dict[str, np.ndarray]:
    """``count`` samples of ``spec``'s training task that neither training nor its validation drew: one
    array per input, and ``labels`` for a classification task (``tk optimize --data`` judges top-1 against
    them; ``tk check``, ``tk infer`` and ``tk export --check-inputs`` leave them out)."""
    if spec.task is None:
        raise UsageError(f"--samples: model {spec.name!r} has no training task to draw samples from")
    if count < 2:
        raise UsageError(f"--samples-count: expected 2 or more samples, got {count}")
    inputs, target = spec.task.make_batch(torch.Generator().manual_seed(seed + SAMPLES_SEED), count)
    arrays = {s.name: t.numpy() for s, t in zip(spec.signature.inputs, inputs, strict=True)}
    if spec.task.classification:
        arrays["labels"] = target.numpy().astype(np.int64)
    return arrays


def train(
    spec: ModelSpec,
    *,
    steps: int | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    seed: int = 0,
    device: str = "cpu",
    compile_options: CompileOptions | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train ``spec.module`` in place on its synthetic task; eager unless ``compile_options`` is given.

    Defaults for steps, batch size and learning rate come from the task. Training stops early
    once the task's ``target_loss`` is reached (averaged over the last steps).
    """
    task, steps, batch_size, lr = _settings(spec, steps, batch_size, lr)
    dev = resolve_device(device)
    torch.manual_seed(seed)
    module = spec.module.to(dev)
    module.train()
    optimizer = task.make_optimizer(module.parameters(), lr)
    data_gen = torch.Generator().manual_seed(seed)
    val_batch = _to(task.make_batch(torch.Generator().manual_seed(seed + 1_000_003), max(batch_size, 64)), dev)

    model: Callable[..., torch.Tensor] = module
    # Dynamo's counters are process-wide: this run's numbers are the change over the run, and
    # other compiled code in the process (an engine, another training) keeps its caches.
    counts_before = _dynamo_counters()
    breaks_before = set(_break_reasons())
    if compile_options is not None:
        model = _compile(module, compile_options)

    counted = counts_before if compile_options is not None else None
    run = _run_steps(
        model,
        optimizer,
        task,
        data_gen,
        dev,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        on_step=on_step,
        counts_before=counted,
    )
    result = _result(module, task, val_batch, run, compiled=compile_options is not None)
    if compile_options is not None:
        _add_compile_counts(result, counts_before, run.frames_after_first, breaks_before)
    return result


def _result(module: nn.Module, task: TrainingTask, val_batch: Any, run: _Steps, *, compiled: bool) -> TrainResult:
    """The run's losses and rates, and the trained model's loss and accuracy on the validation batch."""
    losses, steps_done = run.losses, len(run.losses)
    steady_steps = steps_done - min(WARMUP_STEPS, steps_done)
    rate = steady_steps / (run.end - run.steady_start) if steady_steps > 0 else steps_done / (run.end - run.start)
    val_loss, val_acc = evaluate(module, task, val_batch)
    return TrainResult(
        steps=steps_done,
        final_loss=sum(losses[-task.average_over :]) / len(losses[-task.average_over :]),
        first_loss=losses[0],
        val_loss=val_loss,
        val_accuracy=val_acc,
        seconds=run.end - run.start,
        steps_per_s=rate,
        first_step_s=run.first_step_s,
        compiled=compiled,
        losses=losses,
    )


@dataclass
class _Steps:
    """What the training steps measured: each step's loss and the clock's readings."""

    losses: list[float]
    start: float
    steady_start: float  # after the warm-up steps
    end: float
    first_step_s: float
    frames_after_first: int  # frames Dynamo compiled by the end of the first step (compiled runs)


def _run_steps(
    model: Callable[..., torch.Tensor],
    optimizer: Any,
    task: TrainingTask,
    data_gen: torch.Generator,
    dev: torch.device,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    on_step: Callable[[int, float], None] | None,
    counts_before: dict[str, int] | None,
) -> _Steps:
    """Up to ``steps`` steps, stopping once the task's target loss is reached; a loss that is not finite
    is one ``UsageError`` line. ``counts_before``: Dynamo's counters before the run, for a compiled model."""
    losses: list[float] = []
    first_step_s = 0.0
    steady_start = time.perf_counter()
    start = steady_start
    frames_after_first = 0
    for step in range(steps):
        inputs, target = _to(task.make_batch(data_gen, batch_size), dev)
        t0 = time.perf_counter()
        loss_value = _step(model, optimizer, task, inputs, target)
        if not math.isfinite(loss_value):
            raise UsageError(
                f"training diverged: the loss is {loss_value} at step {step + 1} (learning rate {lr:g}); "
                "no checkpoint was saved: lower --lr"
            )
        if step == 0:
            first_step_s = time.perf_counter() - t0
            if counts_before is not None:
                frames_after_first = _dynamo_counters()["frames"] - counts_before["frames"]
        if step + 1 == min(WARMUP_STEPS, steps):
            steady_start = time.perf_counter()
        losses.append(loss_value)
        if on_step is not None:
            on_step(step + 1, loss_value)
        if _reached_target(task, losses):
            break
    return _Steps(losses, start, steady_start, time.perf_counter(), first_step_s, frames_after_first)


def _add_compile_counts(
    result: TrainResult, counts_before: dict[str, int], frames_after_first: int, breaks_before: set[str]
) -> None:
    """Dynamo's graphs, breaks and recompilations of this run (its process-wide counters' change) into ``result``."""
    counts = {key: value - counts_before[key] for key, value in _dynamo_counters().items()}
    result.graphs = counts["graphs"]
    result.graph_breaks = counts["breaks"]
    result.recompilations = counts["frames"] - frames_after_first
    result.graph_break_reasons = [r for r in _break_reasons() if r not in breaks_before]


def _settings(
    spec: ModelSpec, steps: int | None, batch_size: int | None, lr: float | None
) -> tuple[TrainingTask, int, int, float]:
    """The model's task and the steps, batch size and learning rate to train with (the task's where None)."""
    task = spec.task
    if task is None:
        raise UsageError(f"model {spec.name!r} has no training task: train it in your own code and pass --checkpoint")
    steps = task.steps if steps is None else steps
    batch_size = task.batch_size if batch_size is None else batch_size
    lr = task.lr if lr is None else lr
    if steps < 1 or batch_size < 1 or not math.isfinite(lr) or lr <= 0:
        raise UsageError(
            f"expected --steps >= 1, --batch-size >= 1 and a finite --lr > 0; got {steps}, {batch_size}, {lr}"
        )
    return task, steps, batch_size, lr


def _step(model: Callable[..., torch.Tensor], optimizer: Any, task: TrainingTask, inputs: Any, target: Any) -> float:
    """One optimizer step; the loss as a float (reading it synchronizes the device, so clocks after it are honest)."""
    optimizer.zero_grad(set_to_none=True)
    try:
        out = model(*inputs)
    except torch._dynamo.exc.Unsupported as exc:
        raise capture_error_from(exc) from exc
    loss = task.loss(out, target)
    loss.backward()
    optimizer.step()
    return loss.detach().item()


def _reached_target(task: TrainingTask, losses: list[float]) -> bool:
    """Whether the mean of the last ``task.average_over`` losses is below the task's target."""
    recent = losses[-task.average_over :]
    return (
        task.target_loss is not None
        and len(recent) == task.average_over
        and sum(recent) / len(recent) < task.target_loss
    )


def _to(
    batch: tuple[tuple[torch.Tensor, ...], torch.Tensor], device: torch.device
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    inputs, target = batch
    return tuple(t.to(device) for t in inputs), target.to(device)


@dataclass
class TrainComparison:
    """Eager and compiled training of the same model from the same weights, on the same data."""

    model: dict[str, Any]
    eager: TrainResult
    compiled: TrainResult

    @property
    def speedup(self) -> float:
        """Compiled over eager steps per second, after warm-up."""
        return self.compiled.steps_per_s / self.eager.steps_per_s

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "eager": self.eager.summary(),
            "compiled": self.compiled.summary(),
            "speedup": self.speedup,
        }


def compare_training(
    build: Callable[[], ModelSpec],
    compile_options: CompileOptions,
    *,
    on_start: Callable[[ModelSpec, bool], Callable[[int, float], None] | None] | None = None,
    **train_kwargs: Any,
) -> TrainComparison:
    """Train two copies of ``build()`` from the same weights, eager then compiled, and compare speed.

    ``on_start(spec, compiled)`` may return an ``on_step`` callback for that run (a progress bar).
    """
    eager_spec, compiled_spec = build(), build()
    compiled_spec.module.load_state_dict(eager_spec.module.state_dict())
    runs = []
    for spec, options in ((eager_spec, None), (compiled_spec, compile_options)):
        on_step = on_start(spec, options is not None) if on_start is not None else None
        runs.append(train(spec, compile_options=options, on_step=on_step, **train_kwargs))
    return TrainComparison(eager_spec.reference(), runs[0], runs[1])
