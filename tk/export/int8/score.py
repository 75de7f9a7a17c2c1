"""How the int8 searches score a candidate's outputs on one batch against the float model's: in dB, by the
measure the user's accuracy is judged with (``tk.accuracy``), so that a search stops where the user's bar
does and not elsewhere.

- The outputs' SQNR at the real tokens: a batch x seq x ... output of a model with an attention mask is
  measured where the mask is 1, as the export check and ``--accuracy sqnr`` measure it. The vectors at padding
  positions are computed from nothing and read by no one; on MiniLM's all-int8 package and 32 padded
  sentences they made the SQNR 10.3 dB where the real tokens' was 17.6 (benchmarks/history.md), so a search
  that counted them left out layers to mend values nobody reads.
- With a ``cosine`` bound (``tk optimize --accuracy cosine>=X``): the worst sample's cosine of the
  mask-pooled outputs, as ``--accuracy cosine`` judges it, in the dB of uncorrelated noise that keeps it
  (``sqnr_for_cosine_db``). Its errors are correlated across tokens: pooling does not average them away
  (the same package: 15.5 dB pooled where its tokens held 17.6), so an SQNR floor derived from the cosine
  would have let the search stop short of the user's bar.

Both bounds given, a candidate's score is the lower of the two measures, each shifted so that the score
reaches ``floor_db`` (the higher of the two floors) exactly where both reach their own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tk.accuracy import sqnr_for_cosine_db, token_positions, worst_sample_cosine
from tk.comparison import worst_sqnr_db


@dataclass(frozen=True)
class Int8Accuracy:
    """What an int8 search keeps: the outputs' SQNR at the real tokens (``sqnr_db``) and/or the worst
    sample's cosine of mask-pooled outputs (``cosine``), as ``tk optimize --accuracy`` states them."""

    sqnr_db: float | None = None
    cosine: float | None = None


@dataclass(frozen=True)
class Int8Score:
    """A candidate's score on one batch (``__call__``), in dB; ``floor_db`` is the score its bounds ask for.
    ``mask_name`` / ``mask_position``: where a batch holds the attention mask, by input name (a feeds dict)
    or argument position (a tuple); None: the model takes none, and outputs are measured whole."""

    sqnr_db: float | None = None
    cosine: float | None = None
    mask_name: str | None = None
    mask_position: int | None = None

    @property
    def cosine_db(self) -> float | None:
        return None if self.cosine is None else _cosine_as_db(self.cosine)

    @property
    def floor_db(self) -> float | None:
        floors = [f for f in (self.sqnr_db, self.cosine_db) if f is not None]
        return max(floors) if floors else None

    def mask(self, batch: Any) -> np.ndarray | None:
        """The attention mask in ``batch`` (batch x seq), or None."""
        if isinstance(batch, Mapping):
            found = batch.get(self.mask_name) if self.mask_name is not None else None
        else:
            found = batch[self.mask_position] if self.mask_position is not None else None
        if found is None:
            return None
        mask = np.asarray(found.numpy() if hasattr(found, "numpy") else found)
        return mask if mask.ndim == 2 else None

    def __call__(self, reference: Sequence[np.ndarray], candidate: Sequence[np.ndarray], batch: Any) -> float:
        mask = self.mask(batch)
        floor = self.floor_db
        scores = []
        if self.sqnr_db is not None or self.cosine is None:
            sqnr = _sqnr_at_tokens(reference, candidate, mask)
            scores.append(sqnr if floor is None or self.sqnr_db is None else sqnr + floor - self.sqnr_db)
        cosine_db = self.cosine_db
        if cosine_db is not None and floor is not None:
            pairs = [(np.asarray(r), np.asarray(c)) for r, c in zip(reference, candidate, strict=True)]
            floating = [(r, c) for r, c in pairs if np.issubdtype(r.dtype, np.floating) and r.ndim >= 1]
            worst = min((worst_sample_cosine(r, c, mask) for r, c in floating), default=1.0)
            scores.append(_cosine_as_db(worst) + floor - cosine_db)
        return min(scores)


def _sqnr_at_tokens(reference: Sequence[np.ndarray], candidate: Sequence[np.ndarray], mask: np.ndarray | None) -> float:
    refs = {str(i): np.asarray(r) for i, r in enumerate(reference)}
    keep = token_positions(refs, mask)
    worst = math.inf
    for i, (ref, cand) in enumerate(zip(reference, candidate, strict=True)):
        where = keep.get(str(i))
        ref, cand = np.asarray(ref), np.asarray(cand)
        if where is not None:
            ref, cand = ref[where], cand[where]
        worst = min(worst, worst_sqnr_db([[ref]], [[cand]]))
    return worst


def _cosine_as_db(cosine: float) -> float:
    if math.isnan(cosine) or cosine <= 0:
        return -math.inf
    return math.inf if cosine >= 1 else sqnr_for_cosine_db(cosine)


def int8_score(accuracy: Int8Accuracy, signature_inputs: Sequence[Any]) -> Int8Score:
    """The score of ``accuracy``'s bounds for a model with these inputs (``tk.spec.TensorSpec``): the mask is
    its one input of kind ``mask`` shaped batch x seq, as ``tk.comparison.padding_positions`` finds it."""
    masks = [(i, s) for i, s in enumerate(signature_inputs) if getattr(s, "kind", None) == "mask" and len(s.shape) == 2]
    position, name = (masks[0][0], masks[0][1].name) if len(masks) == 1 else (None, None)
    return Int8Score(accuracy.sqnr_db, accuracy.cosine, mask_name=name, mask_position=position)
