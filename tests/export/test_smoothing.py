"""SmoothQuant-style smoothing: exact in float, one scale per shared input, and it lifts per-tensor int8
on activations with outlier channels (the way Hugging Face encoders' LayerNorm outputs look)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("torchao", reason="int8 aoti packages need torchao (pip install 'tk[int8]')")

from tk.export.aoti.int8 import int8_program
from tk.export.aoti.pt2e import live_module
from tk.export.aoti.smoothing import SMOOTHING_PREFIX, apply_smoothing, plan_smoothing
from tk.parity import worst_sqnr_db
from tk.spec import Dim, Signature, TensorSpec

WIDTH = 32


class _PostNormBlock(torch.nn.Module):
    """A post-norm encoder block: the LayerNorm's output feeds three linears (q, k, v) and the residual;
    two of its channels are 40x the others, as BERT's outlier channels are."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        with torch.no_grad():
            self.norm.weight[[3, 17]] = 40.0
        self.q, self.k, self.v = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mixed = h + self.q(h) * torch.sigmoid(self.k(h)) + self.v(h)
        return mixed + self.down(torch.nn.functional.gelu(self.up(mixed)))


def _setup():
    torch.manual_seed(0)
    module = _PostNormBlock().eval()
    example = (torch.randn(4, 8, WIDTH),)
    program = torch.export.export(module, example, dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=8)},))
    dims = {"batch": Dim("batch", 1, 4, 8)}
    signature = Signature(
        [TensorSpec("x", "float32", ("batch", 8, WIDTH))], [TensorSpec("y", "float32", ("batch", 8, WIDTH))], dims
    )
    rng = np.random.default_rng(1)
    calibration = [{"x": rng.standard_normal((4, 8, WIDTH)).astype(np.float32)} for _ in range(3)]
    return module, program, signature, dims, example, calibration


def test_smoothing_is_exact_in_float_with_one_scale_per_shared_input():
    module, program, _, _, example, calibration = _setup()
    batches = [(torch.from_numpy(c["x"]),) for c in calibration]
    plan = plan_smoothing(live_module(program), batches, alpha=0.8)
    assert len(plan.inputs) == 3  # the norm's output (q, k, v), the mixed sum (up), the GELU (down)
    fused = plan_smoothing(live_module(program), batches, alpha=0.8, after_unary=False)
    assert [len(e.linears) for e in fused.inputs] == [len(e.linears) for e in plan.inputs[:2]]  # not the GELU's
    assert fused.name == "0.8 not after a unary" and plan.name == "0.8"
    shared = next(e for e in plan.inputs if len(e.linears) == 3)
    assert shared.scale[[3, 17]].min() > 4 * shared.scale.median()  # the outlier channels are divided most
    smoothed = apply_smoothing(live_module(program), plan)
    muls = [n for n in smoothed.graph.nodes if n.op == "get_attr" and n.target.startswith(SMOOTHING_PREFIX)]
    assert len(muls) == 3
    x = torch.randn(5, 8, WIDTH)
    want = module(x).detach()
    got = smoothed(x).detach()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # the residual still adds the unscaled output
    assert live_module(program)(*example).equal(module(*example))  # the program itself is not changed


def test_smoothing_is_tried_under_the_floor_and_kept_where_it_helps():
    module, program, signature, dims, example, calibration = _setup()
    _, plain = int8_program(program, signature, dims, example, calibration)
    assert list(plain.smoothing) == ["none"] and plain.smoothing_alpha is None  # no floor: nothing to reach
    quantized, result = int8_program(
        program, signature, dims, example, calibration, min_sqnr_db=80.0, excluded_in_bf16=False
    )  # unreachable: every alpha is tried, then modules are excluded
    # the GELU's output left as captured first (its mul would stop the linear + GELU + quantize fusion)
    assert list(result.smoothing) == ["none", "0.5 not after a unary", "0.8 not after a unary", "0.5", "0.8"]
    # each try judged on every batch, as the export without a floor judged its program
    assert result.smoothing["none"] == pytest.approx(plain.sqnr_db, abs=1e-6)
    best = max(result.smoothing, key=result.smoothing.__getitem__)
    assert best != "none" and result.smoothing[best] > result.smoothing["none"] + 3.0, result.smoothing
    assert result.smoothing_alpha == float(best.split()[0])
    assert result.to_json()["smoothing"]["alpha"] == float(best.split()[0])
    assert result.to_json()["smoothing"].get("after_unary", True) is (" " not in best)
    x = torch.randn(3, 8, WIDTH)  # the kept program is smoothed and still close to the float model
    sqnr = worst_sqnr_db([module(x).detach().numpy()], [quantized.module()(x).detach().numpy()])
    assert sqnr > plain.sqnr_db


def test_inspect_names_the_smoothing_kept():
    from tk.cli.artifact import _quantization_text

    record = {"mode": "static", "quantizable_modules": 4, "int8_modules": 4, "excluded": [], "sqnr_db_export": 21.0}
    assert "smoothed" not in _quantization_text(record | {"smoothing": {"alpha": None}})
    assert "4 of 4 layers int8; smoothed (alpha 0.8); SQNR" in _quantization_text(
        record | {"smoothing": {"alpha": 0.8}}
    )
    assert "smoothed (alpha 0.5, not after a unary); SQNR" in _quantization_text(
        record | {"smoothing": {"alpha": 0.5, "after_unary": False}}
    )
