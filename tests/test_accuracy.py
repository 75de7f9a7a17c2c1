"""The accuracy spec of tk optimize: parsing (good and bad) and judging outputs by it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tk.accuracy import (
    DEFAULT_ACCURACY,
    judge,
    measure_outputs,
    parse_accuracy,
    sqnr_for_cosine_db,
    values_from_report,
)
from tk.errors import UsageError


def test_default_is_sqnr_35() -> None:
    assert str(parse_accuracy(None)) == DEFAULT_ACCURACY == "sqnr>=35"
    assert str(parse_accuracy("  ")) == "sqnr>=35"


def test_several_criteria_parse_in_order() -> None:
    spec = parse_accuracy("sqnr>=40, cosine>=0.9999,top1>=99.5,max_abs<=1e-3")
    assert [(c.metric, c.bound) for c in spec.criteria] == [
        ("sqnr", 40.0), ("cosine", 0.9999), ("top1", 99.5), ("max_abs", 1e-3)
    ]  # fmt: skip
    assert str(spec) == "sqnr>=40,cosine>=0.9999,top1>=99.5,max_abs<=0.001"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("sqnr>35", "expected comma-separated"),
        ("snr>=35", "unknown metric 'snr'"),
        ("sqnr<=35", "sqnr is bounded with >="),
        ("max_abs>=0.1", "max_abs is bounded with <="),
        ("cosine>=1.5", "cosine is between -1 and 1"),
        ("top1>=120", "top1 is a percentage"),
        ("sqnr>=35,sqnr>=40", "sqnr is given twice"),
        ("sqnr>=abc", "expected comma-separated"),
        ("sqnr>=1e999", "expected a finite bound"),
        ("sqnr>=35,", "got ''"),
    ],
)
def test_bad_specs_fail_in_one_line(text: str, says: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_accuracy(text)
    assert says in str(info.value)
    assert "\n" not in str(info.value)


def test_pooled_cosine_ignores_padding_and_top1_counts_agreement() -> None:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 4, 8)).astype(np.float32)
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]])
    cand = ref.copy()
    cand[0, 2:] = 100.0  # garbage at padded positions: pooled over real tokens it does not count
    values, problems = measure_outputs({"h": ref}, {"h": cand}, mask=mask)
    assert problems == []
    assert values["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert values["sqnr"] == math.inf and values["max_abs"] == 0.0  # measured at the real tokens only, too
    cand[1, 3, 0] += 0.5  # a real token's error counts
    values, _ = measure_outputs({"h": ref}, {"h": cand}, mask=mask)
    assert values["max_abs"] == pytest.approx(0.5, rel=1e-6) and values["sqnr"] < math.inf
    logits = np.array([[2.0, 1.0], [0.0, 1.0], [3.0, 0.0], [0.0, 5.0]], dtype=np.float32)
    flipped = logits.copy()
    flipped[1] = [1.0, 0.0]
    values, _ = measure_outputs({"y": logits}, {"y": flipped})
    assert values["top1"] == pytest.approx(75.0)
    values, _ = measure_outputs({"y": logits}, {"y": logits}, labels=np.array([0, 1, 1, 1]))
    assert values["top1"] == pytest.approx(75.0)  # against labels: the float model's own accuracy


def test_judge_names_the_failing_number_and_nan_always_fails() -> None:
    spec = parse_accuracy("sqnr>=60,max_abs<=0.01")
    verdict = judge(spec, {"sqnr": 37.04, "max_abs": 0.002}, where="held-out: ")
    assert not verdict.passed
    assert verdict.failures == ["held-out: sqnr 37.04 dB, needs sqnr>=60"]
    ref = np.ones((2, 3), dtype=np.float32)
    bad = ref.copy()
    bad[0, 0] = np.nan
    values, problems = measure_outputs({"y": ref}, {"y": bad})
    assert problems and "NaN" in problems[0]
    assert not judge(parse_accuracy("max_abs<=10"), values, problems).passed


def test_a_stored_report_counts_tolerance_misses_as_numbers_not_failures() -> None:
    report = {
        "outputs": [
            {
                "name": "logits",
                "passed": False,
                "problem": "max abs error 0.3 exceeds atol 0.1 + ...",
                "max_abs": 0.3,
                "max_rel": 0.1,
                "cosine": 0.999,
                "sqnr_db": 41.5,
                "nan": 0,
                "inf": 0,
                "top1_rate": 1.0,
            },
        ],
        "batch_invariance": {
            "name": "batch invariance",
            "passed": True,
            "problem": None,
            "max_abs": 0.0,
            "max_rel": 0.0,
            "cosine": 1.0,
            "sqnr_db": None,
            "nan": 0,
            "inf": 0,
        },
    }
    values, problems = values_from_report(report)
    assert problems == []
    assert values == {"sqnr": 41.5, "cosine": 0.999, "top1": 100.0, "max_abs": 0.3}
    report["outputs"][0]["problem"] = "shape (2, 3), reference has (2, 2)"
    assert values_from_report(report)[1] == ["logits: shape (2, 3), reference has (2, 2)"]
    assert values_from_report({"outputs": []})[0]["sqnr"] is None  # nothing measured is not a pass


@pytest.mark.parametrize(
    ("text", "floor"),
    [("sqnr>=20", 20.0), ("cosine>=0.99", 16.92), ("cosine>=0.9999", 36.99), ("sqnr>=20,cosine>=0.9999", 36.99),
     ("sqnr>=40,cosine>=0.99", 40.0), ("top1>=99", None), ("max_abs<=0.1,cosine>=1", None)],
)  # fmt: skip
def test_the_exports_sqnr_floor_follows_the_spec(text: str, floor: float | None) -> None:
    got = parse_accuracy(text).sqnr_floor_db
    assert (got is None) if floor is None else got == pytest.approx(floor, abs=0.01)


def test_the_cosine_floor_is_the_cosine_of_uncorrelated_noise_at_that_sqnr() -> None:
    rng = np.random.default_rng(0)
    signal = rng.standard_normal(200_000)
    noise = rng.standard_normal(200_000) * np.sqrt(np.mean(signal**2) / 10 ** (sqnr_for_cosine_db(0.99) / 10))
    noisy = signal + noise
    assert float(signal @ noisy / np.linalg.norm(signal) / np.linalg.norm(noisy)) == pytest.approx(0.99, abs=1e-3)


def test_the_record_keeps_small_values_to_their_significant_digits() -> None:
    values = {"sqnr": 151.23456789012, "cosine": 0.99999999987, "top1": None, "max_abs": 4.47e-08}
    recorded = judge(parse_accuracy("max_abs<=0.1"), values).to_json()["values"]
    assert recorded == {"sqnr": 151.2345679, "cosine": 0.9999999999, "top1": None, "max_abs": 4.47e-08}
