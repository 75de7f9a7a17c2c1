"""The per-layer int8 cost of the aoti int8 path (one calibrated program, each layer's own output) and
the judge that stops a failing exclusion round at its first batch under the target."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("torchao", reason="int8 aoti packages need torchao (pip install 'tk[int8]')")

from tk.export.aoti_int8 import QUANTIZED_TARGETS, _Judge, _Quantizer, quantizable_modules
from tk.export.int8_costs import local_sqnr_db
from tk.models import build_model


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def _prepared(module: nn.Module, batches: list[tuple[torch.Tensor, ...]]) -> torch.fx.GraphModule:
    program = torch.export.export(module.eval(), batches[0])
    return _Quantizer(program, batches, "histogram", [], excluded_in_bf16=False).prepare()


def _sqnr_db(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    r, c = reference.double().numpy(), candidate.double().numpy()
    return 10 * math.log10(float(np.sum(r**2)) / float(np.sum((r - c) ** 2)))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_a_layers_cost_is_its_output_with_input_and_weight_rounded_as_observed():
    torch.manual_seed(0)
    model = _TwoLinears()
    batches = [(torch.randn(8, 16),) for _ in range(3)]
    batches[1][0][:, 3] *= 40  # an outlier channel widens the first layer's input range
    prepared = _prepared(model, batches)
    costs = local_sqnr_db(prepared, batches, QUANTIZED_TARGETS, ["first", "second"])

    # the same rounding done independently, with torch's quantized tensors and the observers' qparams
    first = next(n for n in prepared.graph.nodes if n.target == torch.ops.aten.linear.default)
    x_observer = getattr(prepared, first.args[0].target)
    x_scale, x_zero = x_observer.calculate_qparams()
    w_scale, w_zero = getattr(prepared, first.args[1].target).calculate_qparams()
    weight = torch.quantize_per_channel(model.first.weight.detach(), w_scale, w_zero, 0, torch.qint8).dequantize()
    refs, rounded = [], []
    with torch.no_grad():
        for (x,) in batches:
            x_int = torch.quantize_per_tensor(x, float(x_scale), int(x_zero), torch.quint8).int_repr().float()
            x_int = x_int.clamp(x_observer.quant_min, x_observer.quant_max)  # 0-127 where products saturate
            x_q = (x_int - int(x_zero)) * float(x_scale)
            refs.append(model.first(x))
            rounded.append(nn.functional.linear(x_q, weight, model.first.bias))
    assert costs["first"] == pytest.approx(_sqnr_db(torch.cat(refs), torch.cat(rounded)), abs=1e-6)
    assert set(costs) == {"first", "second"}
    assert 10 < costs["first"] < costs["second"]  # the outlier costs the first layer its bits


def test_an_outlier_channel_ranks_its_layer_costliest():
    spec = build_model("transformer", size="tiny")
    model = spec.module.eval()
    from tk.spec import random_feeds

    feeds = [random_feeds(spec.signature.inputs, {"batch": 8, "seq": 16}, seed=s) for s in range(3)]
    batches = [tuple(torch.from_numpy(f[s.name]) for s in spec.signature.inputs) for f in feeds]
    names = quantizable_modules(torch.export.export(model, batches[0]).module())
    before = local_sqnr_db(_prepared(model, batches), batches, QUANTIZED_TARGETS, names)
    with torch.no_grad():
        model.blocks[1].ln_ffn.weight[5] *= 60  # one channel of blocks.1.ffn.up's input, 60x wider
    after = local_sqnr_db(_prepared(model, batches), batches, QUANTIZED_TARGETS, names)
    assert set(before) == set(after) == set(names) and len(names) == 9
    assert min(after, key=after.__getitem__) == "blocks.1.ffn.up"
    assert after["blocks.1.ffn.up"] < before["blocks.1.ffn.up"] - 10
    assert after["blocks.0.ffn.up"] == pytest.approx(before["blocks.0.ffn.up"], abs=1e-6)  # upstream: unchanged


def test_a_failing_round_stops_at_its_first_batch_under_the_target():
    torch.manual_seed(0)
    model = _TwoLinears().eval()
    batches = [(torch.randn(8, 16),) for _ in range(4)]
    judge = _Judge.of(model, batches)
    calls = []

    def noisy(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return model(x) + 0.01 * torch.randn(8, 4)

    with torch.no_grad():
        full = judge.sqnr_db(noisy)
        assert len(calls) == 4 and math.isfinite(full)
        calls.clear()
        assert judge.headroom_db(noisy, [full + 40] * 4) < 0 and len(calls) == 1
        assert judge.worst_shape == (8, 16)  # the batch it stopped at
        calls.clear()

        def exact(x: torch.Tensor) -> torch.Tensor:
            calls.append(x)
            return model(x)

        assert judge.headroom_db(exact, [full + 40] * 4) == math.inf and len(calls) == 4  # none under: all run


def test_headroom_is_the_least_sqnr_over_each_batchs_own_target():
    torch.manual_seed(0)
    model = _TwoLinears().eval()
    batches = [(torch.randn(8, 16),) for _ in range(3)]
    judge = _Judge.of(model, batches)
    noise = [torch.randn(8, 4) * scale for scale in (0.001, 0.01, 0.1)]  # batch i gets 10x the noise of i-1
    calls = []

    def noisy(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return model(x) + noise[len(calls) - 1]

    with torch.no_grad():
        sqnr = judge.per_batch(noisy)
        assert sqnr[0] > sqnr[1] > sqnr[2]
        calls.clear()
        targets = [sqnr[0] - 1, sqnr[1] - 5, sqnr[2] - 3]
        assert judge.headroom_db(noisy, targets) == pytest.approx(1.0) and len(calls) == 3
        assert judge.worst_sqnr_db == pytest.approx(sqnr[2]) and judge.worst_shape == (8, 16)
        calls.clear()
        assert judge.headroom_db(noisy, [sqnr[0] - 1, sqnr[1] + 2, 0.0]) == pytest.approx(-2.0) and len(calls) == 2
