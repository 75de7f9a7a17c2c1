"""torchvision's MobileNetV3-Small (10 classes) with its BatchNorm statistics recalibrated on random images, so
that its activations spread as a trained network's do (freshly initialised, its outputs are ~1e-9 and every
int8 writer reads 0 dB). A user model for ``tk optimize`` (history: "The floor of a small CNN")::

    tk optimize benchmarks.mobilenet_calibrated:model --input x:float32:8x3x160x160 --out OUT --seconds 1
"""

import torch
import torchvision


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torchvision.models.mobilenet_v3_small(num_classes=10)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None  # a cumulative average over the batches
    net.train()
    with torch.no_grad():
        for _ in range(8):
            net(torch.randn(16, 3, 160, 160))
    return net.eval()
