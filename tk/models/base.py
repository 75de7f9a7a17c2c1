"""What a model is to the rest of ``tk``: a module, its signature, and a training task.

Each built-in model file defines a config dataclass, its sizes, and a ``ModelEntry`` built from
these types; ``tk.models.registry`` lists the entries.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tk.errors import UsageError, first_line
from tk.spec import Dim, Signature, TensorSpec, random_feeds

Batch = Callable[[torch.Generator, int], tuple[tuple[torch.Tensor, ...], torch.Tensor]]  # (gen, n) -> (inputs, labels)


@dataclass
class TrainingTask:
    """A synthetic task the model can learn in a few hundred steps."""

    make_batch: Batch
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    make_optimizer: Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]
    lr: float  # default learning rate
    steps: int  # default number of steps
    batch_size: int  # default batch size
    target_loss: float | None = None  # stop once the average training loss falls below this
    average_over: int = 10  # steps averaged for the final loss and the early stop
    classification: bool = True  # report accuracy as well as loss at validation


def classification_task(make_batch: Batch, *, lr: float, steps: int, batch_size: int) -> TrainingTask:
    """A classification task trained with cross-entropy and AdamW (weight decay 0.01, torch's default)."""
    return TrainingTask(
        make_batch=make_batch,
        loss=torch.nn.functional.cross_entropy,
        make_optimizer=lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        lr=lr,
        steps=steps,
        batch_size=batch_size,
    )


def classifier_signature(
    inputs: list[TensorSpec], num_classes: int, *, batch_max: int, dims: dict[str, Dim] | None = None
) -> Signature:
    """``inputs`` -> float32 ``logits`` (batch, num_classes); batch from 1 to ``batch_max`` (opt 8), plus ``dims``."""
    return Signature(
        inputs=inputs,
        outputs=[TensorSpec("logits", "float32", ("batch", num_classes))],
        dims={"batch": Dim("batch", 1, 8, batch_max), **(dims or {})},
    )


@dataclass
class ModelSpec:
    """One model ready to train or export: the module, its inputs and outputs, its task."""

    name: str  # registry name or ``package.module:callable``
    size: str | None
    config: dict[str, Any]
    module: nn.Module
    signature: Signature
    task: TrainingTask | None = None
    tolerances: dict[str, tuple[float, float]] = field(default_factory=dict)  # precision -> (rtol, atol)
    input_descriptions: tuple[str, ...] = ()  # a user model's --input descriptions, to rebuild it later
    # dimension -> the largest size the model takes (a learned position table's length); none: no limit
    max_sizes: dict[str, int] = field(default_factory=dict)
    # a decoder's generation facts (cache layout, special tokens): the manifest's ``generation``; None: not a decoder
    generation: dict[str, Any] | None = None

    def example_inputs(self, sizes: dict[str, int] | None = None, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Valid random inputs at ``sizes`` (default: each dimension's opt size), in input order."""
        feeds = random_feeds(self.signature.inputs, sizes or self.signature.opt_sizes(), seed=seed)
        return tuple(torch.from_numpy(feeds[s.name]) for s in self.signature.inputs)

    def reference(self) -> dict[str, Any]:
        """What the manifest and checkpoint sidecar record to rebuild this model."""
        ref: dict[str, Any] = {"name": self.name, "size": self.size, "config": self.config}
        if self.input_descriptions:
            ref["input_descriptions"] = list(self.input_descriptions)
        return ref


@dataclass(frozen=True)
class ModelEntry:
    """A registry entry: builds a ``ModelSpec`` from a size or a config."""

    name: str
    description: str
    config_cls: type
    sizes: dict[str, Any]  # size name -> config instance
    build_spec: Callable[[Any], ModelSpec]
    requires: str | None = None  # install hint when an optional package is missing
    available: Callable[[], bool] = lambda: True

    def build(self, size: str | None = None, config: dict[str, Any] | None = None) -> ModelSpec:
        if not self.available():
            raise UsageError(f"model {self.name!r} needs an optional package: {self.requires}")
        if config is not None:
            known = {f.name for f in dataclasses.fields(self.config_cls)}
            unknown = sorted(set(config) - known)
            if unknown:
                raise UsageError(
                    f"model {self.name!r}: unknown config key(s) {', '.join(unknown)}; expected some of {', '.join(sorted(known))}"
                )
            cfg = self.config_cls(**config)
        else:
            size = size or "small"
            if size not in self.sizes:
                raise UsageError(f"model {self.name!r}: expected a size in {', '.join(self.sizes)}, got {size!r}")
            cfg = self.sizes[size]
        spec = self.build_spec(cfg)
        spec.size = size
        spec.config = dataclasses.asdict(cfg)
        return spec


def import_callable(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # a user's module can fail (or exit) in any way while importing
        raise UsageError(
            f"model {path!r}: cannot import {module_name!r}: {type(exc).__name__}: {first_line(exc)}"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UsageError(f"model {path!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(f"model {path!r}: expected a callable, found {type(target).__name__}")
    return target
