"""The int8 searches' score: the outputs' SQNR at the real tokens, and the user's pooled cosine in dB."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tk.accuracy import measure_outputs, parse_accuracy, sqnr_for_cosine_db
from tk.export.int8.evaluator import Evaluator, FeedsRunner, whole_sqnr_db
from tk.export.int8.score import Int8Accuracy, Int8Score, int8_score
from tk.spec import TensorSpec
from tk.workflows.optimize.run import int8_accuracy

MASK = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=np.int64)


def _outputs(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A batch x seq x hidden reference, and a candidate equal to it but for noise 30 dB under it at the
    real tokens and garbage (the reference's size) at the padding positions."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((2, 6, 16))
    noise = rng.standard_normal(ref.shape) * np.sqrt(np.mean(ref**2) / 1000)
    garbage = rng.standard_normal(ref.shape)
    real = MASK[..., None].astype(bool)
    return ref, np.where(real, ref + noise, garbage)


def _sqnr(ref: np.ndarray, cand: np.ndarray) -> float:
    return 10 * math.log10(float(np.sum(ref**2)) / float(np.sum((ref - cand) ** 2)))


def test_the_sqnr_is_measured_at_the_real_tokens_only() -> None:
    ref, cand = _outputs()
    real = np.broadcast_to(MASK[..., None].astype(bool), ref.shape)
    at_tokens = _sqnr(ref[real], cand[real])
    assert 28 < at_tokens < 32
    score = Int8Score(sqnr_db=25.0, mask_name="attention_mask")
    assert score([ref], [cand], {"attention_mask": MASK}) == pytest.approx(at_tokens, abs=1e-9)
    # measured whole, the garbage at the padding positions sinks it: what the searches judged before
    assert whole_sqnr_db([ref], [cand], {"attention_mask": MASK}) < 3.0
    # without a mask in the batch (a model that takes none) the outputs are measured whole
    assert score([ref], [cand], {"input_ids": MASK}) == pytest.approx(_sqnr(ref, cand), abs=1e-9)


def test_the_mask_is_found_by_argument_position_in_a_tuple_batch() -> None:
    ref, cand = _outputs()
    inputs = [TensorSpec("input_ids", "int64", ("batch", "seq"), kind="ids", low=0, high=100),
              TensorSpec("attention_mask", "int64", ("batch", "seq"), kind="mask")]  # fmt: skip
    score = int8_score(Int8Accuracy(sqnr_db=25.0), inputs)
    assert (score.mask_name, score.mask_position) == ("attention_mask", 1)
    by_tuple = score([ref], [cand], (torch.zeros(2, 6, dtype=torch.int64), torch.from_numpy(MASK)))
    by_name = score([ref], [cand], {"input_ids": np.zeros((2, 6)), "attention_mask": MASK})
    assert by_tuple == by_name
    assert by_tuple > 28
    no_mask = int8_score(Int8Accuracy(sqnr_db=25.0), inputs[:1])
    assert (no_mask.mask_name, no_mask.mask_position) == (None, None)


def test_the_cosine_score_is_the_judges_pooled_cosine_in_db() -> None:
    """The score of a cosine bound is the worst sample's cosine of mask-pooled outputs, as tk optimize's
    judge measures it (tk.accuracy.measure_outputs), in the dB of uncorrelated noise; noise shared by every
    token (a layer's bias error, say) is not averaged away by the pooling."""
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((2, 6, 16))
    shared = rng.standard_normal((2, 1, 16)) * 0.05  # the same error at every token of a sample
    cand = ref + shared
    judged, _ = measure_outputs({"y": ref}, {"y": cand}, mask=MASK)
    score = Int8Score(cosine=0.999, mask_name="attention_mask")
    got = score([ref], [cand], {"attention_mask": MASK})
    assert got == pytest.approx(sqnr_for_cosine_db(judged["cosine"]), abs=1e-6)
    assert score.floor_db == pytest.approx(sqnr_for_cosine_db(0.999))
    # pooling gained nothing against the per-token error here: the pooled score is under the tokens' SQNR
    real = np.broadcast_to(MASK[..., None].astype(bool), ref.shape)
    assert got < _sqnr(ref[real], cand[real])


def test_both_bounds_score_the_lower_of_the_two_on_the_higher_floor() -> None:
    ref, cand = _outputs()
    batch = {"attention_mask": MASK}
    sqnr = Int8Score(sqnr_db=20.0, mask_name="attention_mask")([ref], [cand], batch)
    cosine = Int8Score(cosine=0.999, mask_name="attention_mask")([ref], [cand], batch)
    both = Int8Score(sqnr_db=20.0, cosine=0.999, mask_name="attention_mask")
    floor = sqnr_for_cosine_db(0.999)
    assert both.floor_db == pytest.approx(floor)
    # each measure shifted so that it reaches the floor where it reaches its own bound
    assert both([ref], [cand], batch) == pytest.approx(min(sqnr + floor - 20.0, cosine), abs=1e-9)
    assert Int8Score(sqnr_db=40.0, cosine=0.999).floor_db == 40.0


def test_a_nan_scores_minus_infinity() -> None:
    ref, cand = _outputs()
    cand = cand.copy()
    cand[0, 0, 0] = np.nan
    assert Int8Score(cosine=0.999, mask_name="attention_mask")([ref], [cand], {"attention_mask": MASK}) == -math.inf


class _Scaled(FeedsRunner):
    """A float model y = x @ w; a candidate is a weight matrix, run the same way."""

    def open(self, model: np.ndarray):  # type: ignore[override]
        return lambda batch: [batch["x"] @ model]


def test_the_evaluator_and_its_subsets_judge_by_the_score() -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 16))
    xs = [{"x": rng.standard_normal((2, 6, 16)), "attention_mask": MASK} for _ in range(3)]
    candidate = w + rng.standard_normal(w.shape) * 0.01
    score = Int8Score(sqnr_db=25.0, mask_name="attention_mask")
    evaluator = Evaluator.of(_Scaled(w), xs, score)
    expected = [score([x["x"] @ w], [x["x"] @ candidate], x) for x in xs]
    assert evaluator.per_batch(candidate) == pytest.approx(expected)
    assert evaluator.subset([2]).sqnr_db(candidate) == pytest.approx(expected[2])


@pytest.mark.parametrize(
    ("text", "expected"),
    [("cosine>=0.999", Int8Accuracy(None, 0.999)), ("sqnr>=30,top1>=99", Int8Accuracy(30.0, None)),
     ("cosine>=0.99,sqnr>=20", Int8Accuracy(20.0, 0.99)), ("top1>=99", None)],
)  # fmt: skip
def test_optimize_hands_the_searches_the_users_own_bounds(text: str, expected: Int8Accuracy | None) -> None:
    assert int8_accuracy(parse_accuracy(text)) == expected
