"""The per-layer int8 cost of the aoti int8 path (the program's SQNR with that layer alone in int8) and
the judge that stops a failing exclusion round at its first batch under the target."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytest.importorskip("torchao", reason="int8 aoti packages need torchao (pip install 'tk[int8]')")

from tk.export.aoti.int8 import ProgramUnits
from tk.export.aoti.pt2e import Quantizer, program_evaluator, quantizable_modules
from tk.export.int8.search import one_at_a_time_sqnr_db
from tk.models import build_model


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def _costs(module: nn.Module, batches: list[tuple[torch.Tensor, ...]], names: list[str]) -> dict[str, float]:
    program = torch.export.export(module.eval(), batches[0])
    quantizer = Quantizer(program, batches, "histogram", [], excluded_in_bf16=False)
    return one_at_a_time_sqnr_db(ProgramUnits(quantizer, names), program_evaluator(quantizer.float_module, batches))


def test_an_outlier_channel_ranks_its_layer_costliest():
    spec = build_model("transformer", size="tiny")
    model = spec.module.eval()
    from tk.spec import random_feeds

    feeds = [random_feeds(spec.signature.inputs, {"batch": 8, "seq": 16}, seed=s) for s in range(3)]
    batches = [tuple(torch.from_numpy(f[s.name]) for s in spec.signature.inputs) for f in feeds]
    names = quantizable_modules(torch.export.export(model, batches[0]).module())
    before = _costs(model, batches, names)
    with torch.no_grad():
        model.blocks[1].ln_ffn.weight[5] *= 60  # one channel of blocks.1.ffn.up's input, 60x wider
    after = _costs(model, batches, names)
    assert set(before) == set(after) == set(names) and len(names) == 9
    assert all(math.isfinite(v) and v > 10 for v in before.values())
    assert min(after, key=after.__getitem__) == "blocks.1.ffn.up"
    assert after["blocks.1.ffn.up"] < before["blocks.1.ffn.up"] - 10


def test_a_failing_round_stops_at_its_first_batch_under_the_target():
    torch.manual_seed(0)
    model = _TwoLinears().eval()
    batches = [(torch.randn(8, 16),) for _ in range(4)]
    judge = program_evaluator(model, batches)
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
    judge = program_evaluator(model, batches)
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


def test_references_run_when_a_batch_is_first_judged_and_the_lower_target_only_under_the_target():
    torch.manual_seed(0)
    model = _TwoLinears().eval()
    batches = [(torch.randn(8, 16),) for _ in range(4)]
    noise = {id(b[0]): torch.randn(8, 4) * s for b, s in zip(batches, (0.001, 0.001, 0.1, 0.001), strict=True)}

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return model(x) + noise[id(x)]

    referenced = []

    def float_model(x: torch.Tensor) -> torch.Tensor:
        referenced.append(id(x))
        return model(x)

    with torch.no_grad():
        sqnr = program_evaluator(model, batches).per_batch(noisy)
        assert sqnr[2] < min(sqnr[0], sqnr[1], sqnr[3]) - 20  # 100x the noise: 40 dB under the others
        judge = program_evaluator(float_model, batches)
        assert referenced == []
        screen = judge.subset([0, 2])
        target = sqnr[2] + 10
        asked = []

        def held_to(index: int) -> float:
            asked.append(index)
            return sqnr[2] - 1

        assert screen.headroom_db(noisy, [target, target], held_to=held_to) == pytest.approx(1.0)
        assert asked == [2]  # batch 0 cleared the target: no lower one asked for
        assert referenced == [id(batches[0][0]), id(batches[2][0])]  # only the screen's references
        assert screen.headroom_db(noisy, [target, target]) == pytest.approx(-10.0)  # without it: 10 dB under
        assert judge.per_batch(noisy) == pytest.approx(sqnr)
        assert sorted(referenced) == sorted(id(b[0]) for b in batches)  # each reference computed once
