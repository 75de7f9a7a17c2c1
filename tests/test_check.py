"""Parity numbers: compare() on arrays whose errors are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tk.parity import compare, compare_output
from tk.spec import Dim
from tk.tolerances import tolerance_for


def test_identical_outputs_pass_with_zero_error():
    ref = np.linspace(-3, 3, 50, dtype=np.float32).reshape(5, 10)
    result = compare_output("y", ref, ref.copy(), rtol=1e-4, atol=1e-5)
    assert result.passed and result.max_abs == 0 and result.cosine == pytest.approx(1.0) and math.isinf(result.sqnr_db)


def test_known_error_is_measured_exactly():
    ref = np.array([[1.0, -2.0, 4.0]], dtype=np.float32)
    cand = ref + np.array([[0.0, 0.01, -0.02]], dtype=np.float32)
    result = compare_output("y", ref, cand, rtol=1e-4, atol=1e-5)
    assert result.max_abs == pytest.approx(0.02, rel=1e-5)
    assert result.max_rel == pytest.approx(0.02 / 4.0, rel=1e-5)
    assert not result.passed and "exceeds" in result.problem
    loose = compare_output("y", ref, cand, rtol=1e-2, atol=1e-2)
    assert loose.passed


def test_sqnr_in_decibels():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(10_000)
    noise = rng.standard_normal(10_000) * 0.01  # 40 dB below the signal
    result = compare_output("y", ref, ref + noise, rtol=1, atol=1, min_sqnr_db=30)
    assert result.sqnr_db == pytest.approx(40.0, abs=0.3) and result.passed
    assert not compare_output("y", ref, ref + noise, rtol=1, atol=1, min_sqnr_db=45).passed


def test_nan_in_candidate_fails():
    ref = np.ones((2, 2), dtype=np.float32)
    cand = ref.copy()
    cand[0, 0] = np.nan
    result = compare_output("y", ref, cand, rtol=1e-4, atol=1e-5)
    assert not result.passed and result.nan == 1


def test_names_then_shapes_are_compared_and_every_failure_reported():
    ref = {"a": np.zeros((2, 3)), "b": np.zeros(2)}
    cand = {"a": np.zeros((2, 4)), "c": np.zeros(2)}
    results = {r.name: r for r in compare(ref, cand, rtol=1e-4, atol=1e-5)}
    assert set(results) == {"a", "b", "c"}
    assert "shape (2, 4)" in results["a"].problem
    assert "missing" in results["b"].problem
    assert "unexpected" in results["c"].problem


def test_tolerance_table_and_overrides():
    assert tolerance_for("fp32") == (1e-4, 1e-5)
    assert tolerance_for("fp32", model_overrides={"fp32": (1e-3, 1e-3)}) == (1e-3, 1e-3)
    assert tolerance_for("bf16", rtol=0.1) == (0.1, tolerance_for("bf16")[1])


def test_dim_sizes_to_check_cover_the_range_with_an_odd_size():
    sizes = Dim("batch", 1, 8, 64).sizes_to_check()
    assert sizes[0] == 1 and sizes[-1] == 64 and 8 in sizes
    assert any(s % 2 == 1 and 1 < s < 64 for s in sizes)


def test_nan_and_inf_must_sit_where_the_reference_has_them():
    ref = np.array([np.nan, 1.0, np.inf, 2.0])
    assert compare_output("y", ref, ref.copy(), rtol=1e-4, atol=1e-5).passed
    moved = np.array([1.0, np.nan, np.inf, 2.0])
    assert not compare_output("y", ref, moved, rtol=1e-4, atol=1e-5).passed
    flipped = np.array([np.nan, 1.0, -np.inf, 2.0])
    assert not compare_output("y", ref, flipped, rtol=1e-4, atol=1e-5).passed
    finite = np.array([0.0, 1.0, 5.0, 2.0])
    assert not compare_output("y", ref, finite, rtol=1e-4, atol=1e-5).passed


def test_padding_positions_are_left_out_of_token_level_outputs_only():
    from tk.parity import padding_positions
    from tk.spec import TensorSpec

    inputs = [
        TensorSpec("input_ids", "int64", ("batch", "seq"), kind="ids"),
        TensorSpec("attention_mask", "int64", ("batch", "seq"), kind="mask"),
    ]
    outputs = [TensorSpec("hidden", "float32", ("batch", "seq", 4)), TensorSpec("pooled", "float32", ("batch", 4))]
    mask = np.array([[1, 1, 1], [1, 0, 0]])
    ref = {"hidden": np.ones((2, 3, 4), np.float32), "pooled": np.ones((2, 4), np.float32)}
    cand = {"hidden": ref["hidden"].copy(), "pooled": ref["pooled"] + 1e-3}
    cand["hidden"][1, 1:] += 5.0  # garbage where the mask is 0: what no consumer reads
    valid = padding_positions(inputs, outputs, {"input_ids": np.zeros((2, 3)), "attention_mask": mask}, ref)
    assert set(valid) == {"hidden"} and int(valid["hidden"].sum()) == 4 * 4
    hidden, pooled = compare(ref, cand, rtol=0.0, atol=1e-5, valid=valid)
    assert hidden.passed and hidden.max_abs == 0.0 and hidden.padding_skipped == 8
    assert not pooled.passed and pooled.max_abs == pytest.approx(1e-3, rel=1e-3)  # other shapes: compared whole
    cand["hidden"][1, 0, 0] += 1e-2  # a token's error is still caught
    (hidden, _) = compare(ref, cand, rtol=0.0, atol=1e-5, valid=valid)
    assert not hidden.passed and hidden.max_abs == pytest.approx(1e-2, rel=1e-3)
    cand["hidden"][1, 2, 0] = np.nan  # a NaN at a padding position still fails: a masked mean of it is NaN
    (hidden, _) = compare(ref, cand, rtol=0.0, atol=1.0, valid=valid)
    assert not hidden.passed and hidden.nan == 1 and "NaN" in (hidden.problem or "")
    full = {"input_ids": np.zeros((2, 3)), "attention_mask": np.ones((2, 3))}
    assert padding_positions(inputs, outputs, full, ref) == {}  # no padding: nothing left out


def test_the_noise_floor_widens_the_absolute_tolerance_by_k_floors():
    from tk.tolerances import NOISE_FLOOR_K

    ref = np.array([[0.0, 30.0, -0.002]])
    cand = ref + np.array([[5e-5, -4e-5, 0.0]])  # a deep network's rounding: the same absolute size everywhere
    fixed = compare_output("y", ref, cand, rtol=1e-4, atol=1e-5)
    assert not fixed.passed and fixed.floor is None and "noise floor" not in fixed.problem
    within = compare_output("y", ref, cand, rtol=1e-4, atol=1e-5, floor=1e-5)  # allows 1e-5 + 8e-5 at 0
    assert within.passed and within.floor == 1e-5 and within.floor_ratio == pytest.approx(5.0)
    low = compare_output("y", ref, cand, rtol=1e-4, atol=1e-5, floor=4e-6)  # allows 1e-5 + 3.2e-5 at 0
    assert not low.passed and f"{NOISE_FLOOR_K:g} x noise floor 4e-06" in low.problem
    assert "1 of 3 values" in low.problem  # 30 has rtol's 3e-3 besides; -0.002 is exact
    zero = compare_output("y", ref, ref.copy(), rtol=1e-4, atol=1e-5, floor=0.0)
    assert zero.passed and zero.floor == 0.0 and zero.floor_ratio is None


def test_reference_signal_names_constant_and_near_zero_references():
    from tk.parity import reference_signal

    rng = np.random.default_rng(0)
    varying = rng.standard_normal((4, 3))
    assert reference_signal([varying, varying[:1]], 1e-5, batched=True) is None
    assert reference_signal([np.zeros((4, 3))], 1e-5, batched=True) == "near zero"
    assert reference_signal([np.full((4, 3), 1e-16)], 1e-5, batched=True) == "near zero"  # EfficientNet's 1e-16
    bias_only = np.tile(np.array([0.5, -0.5, 2.0]), (4, 1))  # a zeroed head's bias: every sample the same
    assert reference_signal([bias_only, bias_only[:2]], 1e-5, batched=True) == "constant"
    assert reference_signal([bias_only[:1]], 1e-5, batched=True) is None  # one sample: its values vary
    assert reference_signal([np.full((1, 3), 2.0)], 1e-5, batched=True) == "constant"
    assert reference_signal([np.array([[1e-4, -1e-4]])], 1e-5 + 8 * 2e-5, batched=True) == "near zero"
    assert reference_signal([np.array([[np.nan, 1.0]])], 1e-5, batched=True) is None  # NaN: judged elsewhere
    assert reference_signal([np.arange(6).reshape(2, 3)], 1e-5, batched=True) is None  # integers: no floor, no signal


def test_a_noise_floor_survives_its_json():
    from tk.parity import NoiseFloor

    floor = NoiseFloor([{"y": 2e-5}, {"y": 3e-5, "z": 1e-7}], {"y": 4e-5})
    data = floor.to_json()
    assert data["measured"] == "eager float32 vs float64" and "note" not in data
    assert NoiseFloor.from_json(data) == floor and floor.largest() == {"y": 3e-5, "z": 1e-7}
    missing = NoiseFloor(batch={"y": 1e-6}, note="the model cannot run in float64 (x)")
    assert "per_run" not in missing.to_json() and NoiseFloor.from_json(missing.to_json()) == missing
    assert not missing.measured and missing.largest() == {}


def test_a_tolerance_the_user_gives_is_the_whole_rule():
    from tk.parity import NoiseFloor, report_from_outputs

    ref = {"y": np.array([[0.0, 1.0]]), "z": np.array([[0.0, 1.0]])}
    cand = {"y": ref["y"] + 5e-5, "z": ref["z"] + 5e-5}
    floor = NoiseFloor([{"y": 1e-5, "z": 1e-5}])

    def judged(noise_floor, tolerances=None):
        report = report_from_outputs(
            "onnx", ref, cand, precision="fp32", rtol=1e-4, atol=1e-5, noise_floor=noise_floor, tolerances=tolerances
        )
        return {o.name: o.passed for o in report.outputs}

    assert judged(floor) == {"y": True, "z": True}  # 5e-5 is within 1e-5 + 8 floors
    assert judged(floor, {"y": (1e-4, 1e-5)}) == {"y": False, "z": True}  # --tol y=...: no floor for y
    assert judged(NoiseFloor([{"y": 1e-5, "z": 1e-5}], applied=False)) == {"y": False, "z": False}  # --rtol/--atol
    assert judged(None) == {"y": False, "z": False}
    report = report_from_outputs("onnx", ref, cand, precision="bf16", rtol=1e-4, atol=1e-5, noise_floor=floor)
    assert report.noise_floor is None  # reduced precisions add no floor
    assert NoiseFloor.from_json(NoiseFloor(applied=False).to_json()).applied  # applying is each check's choice


@pytest.mark.parametrize(
    ("record", "fragment"),
    [({"k": 8, "per_run": [{"logits": "abc"}]}, "not the record tk writes"),
     ({"k": 8, "per_run": [{"logits": float("inf")}]}, "not the record tk writes"),
     ({"k": 8, "per_run": [{"logits": -1.0}]}, "not the record tk writes"),
     ({"k": 1e6, "per_run": [{"logits": 1e-6}]}, "tk judges with 8")],
)  # fmt: skip
def test_a_recorded_floor_that_tk_did_not_write_is_one_line(record, fragment):
    from tk.errors import IntegrityError
    from tk.reference import NoiseFloor

    with pytest.raises(IntegrityError, match=fragment):
        NoiseFloor.from_json(record)


def test_an_unsigned_manifest_cannot_widen_the_golden_check(exported, tmp_path):
    """A tampered graph with its manifest's floor raised to 1e3 and re-hashed (no key needed): the recorded
    floor is ignored, so the golden check still fails."""
    import shutil

    import onnx
    from click.testing import CliRunner

    from tests.conftest import rehash
    from tk.cli import cli
    from tk.manifest import manifest_bytes, read_manifest

    root = tmp_path / "art"
    shutil.copytree(exported("mlp", ("onnx",)).root, root)
    golden = tmp_path / "golden.npz"
    saved = CliRunner().invoke(cli, ["check", str(root), "--engine", "onnx", "--save-golden", str(golden)])
    assert saved.exit_code == 0, saved.output
    model = onnx.load(str(root / "model.onnx"))
    weight = next(i for i in model.graph.initializer if len(i.dims) == 2)
    values = onnx.numpy_helper.to_array(weight) * 1.5
    weight.CopyFrom(onnx.numpy_helper.from_array(values, weight.name))
    manifest = read_manifest(root)
    for report in manifest.check.values():
        report["noise_floor"] = {**report.get("noise_floor", {}), "k": 8,
                                 "per_run": [{"logits": 1e3}] * len(report["shapes"])}  # fmt: skip
    (root / "manifest.json").write_bytes(manifest_bytes(manifest))
    rehash(root, {"model.onnx": model.SerializeToString()})
    result = CliRunner().invoke(cli, ["check", str(root), "--engine", "onnx", "--golden", str(golden)])
    assert result.exit_code == 1, result.output
    assert "parity failed for onnx" in result.output or "FAIL" in result.output, result.output
