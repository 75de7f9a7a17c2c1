"""torchvision's resnet18, trained to find which quadrant of an image holds a bright square."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from tk.models.base import ModelEntry, ModelSpec, TrainingTask, classification_task, classifier_signature
from tk.spec import TensorSpec


@dataclass
class ResNetConfig:
    num_classes: int = 4  # outputs of the final layer (the task uses 4 quadrants)
    image_size: int = 224  # height and width of the input images


SIZES = {
    "tiny": ResNetConfig(image_size=32),
    "small": ResNetConfig(image_size=128),
    "base": ResNetConfig(num_classes=1000),
}


def make_task(cfg: ResNetConfig) -> TrainingTask:
    size = cfg.image_size
    half = size // 2
    square = max(2, size // 4)

    def make_batch(gen: torch.Generator, batch: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        labels = torch.randint(0, 4, (batch,), generator=gen)
        images = 0.5 * torch.randn(batch, 3, size, size, generator=gen)
        offsets = torch.randint(0, half - square + 1, (batch, 2), generator=gen)
        for i in range(batch):
            top = int(offsets[i, 0]) + half * int(labels[i] // 2)
            left = int(offsets[i, 1]) + half * int(labels[i] % 2)
            images[i, :, top : top + square, left : left + square] += 2.0
        return (images,), labels % cfg.num_classes

    return classification_task(make_batch, lr=1e-3, steps=100, batch_size=16)


def build(cfg: ResNetConfig) -> ModelSpec:
    import torchvision

    inputs = [TensorSpec("images", "float32", ("batch", 3, cfg.image_size, cfg.image_size))]
    signature = classifier_signature(inputs, cfg.num_classes, batch_max=64)
    module = torchvision.models.resnet18(weights=None, num_classes=cfg.num_classes)
    return ModelSpec("resnet18", None, {}, module, signature, make_task(cfg), tolerances={"fp32": (1e-4, 1e-4)})


ENTRY = ModelEntry(
    name="resnet18",
    description="torchvision resnet18 finding the bright quadrant of an image",
    config_cls=ResNetConfig,
    sizes=SIZES,
    build_spec=build,
    requires="torchvision is not installed: pip install 'tk[vision]' (or pip install torchvision matching your torch)",
    available=lambda: importlib.util.find_spec("torchvision") is not None,
)
