"""Whether the float32 candidates can still win: a reduced float precision's matrix products against float32's.

On a CPU with AVX512-BF16 or AMX, once a bf16 candidate keeps the user's accuracy, the float32 candidates
(four formats and the unfused onnx graph: about a quarter of a small Transformer's optimize run) only
cost time: their products run at half the bf16 rate or less. Before the float32 groups are written, the
two rates are measured at the model's own linear shapes at the timing size (``tk.workflows.roofline``'s
``ShapePeak``: oneDNN-packed, as the packages run them), interleaved, and the float32 groups are skipped
when the reduced precision is clearly faster where the model spends its work. The rule is a prediction,
so it is kept for the cases where it cannot be wrong by a tie: the products carry most of the model's
FLOPs, the call is large enough for a rate to mean something, and the rate is at least ``FASTER_BY``
float32's (interleaved p50s of one model in two formats differ by 1-4% on our machines; the small
Transformer's bf16 package ran 2.4x the best float32 candidate where the rates differed 1.95x).

Where an aoti int8 candidate is to come, the race measures oneDNN's int8 linear at the same shapes too:
when it runs ``FASTER_BY`` the reduced precision's rate (by the same rule), the speed gate does not
compile the all-int8 package to ask whether int8 can win (about 30 s of the small Transformer's run): its
answer there was always yes (the all-int8 package 1.35-1.43x the bf16 package's speed where the products
differed 1.58x on the AVX512-BF16 EPYC), and a wrong yes costs only a search, never the winner. On a
CPU without bfloat16 dot products (no reduced float candidate to race), int8 is raced against float32
alone, once the float32 groups are judged, by the same rule: on the AVX512-VNNI Xeon without bf16 the
probe compile it saves took about a minute of a 10-minute run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tk.workflows.roofline import Roofline

FASTER_BY = 1.5  # the reduced precision's rate over float32's at the model's shapes
LINEAR_SHARE = 0.8  # of the model's FLOPs in its nn.Linear products
MIN_GFLOP = 1.0  # per call at the timing size: below it per-call overheads, not products, decide
ROUNDS = 7


@dataclass(frozen=True)
class PrecisionRace:
    """The reduced precision's and float32's median rates at the model's linear shapes, and how much
    of the model's work those shapes are."""

    precision: str
    rate_gflops: float
    fp32_rate_gflops: float
    linear_gflop: float  # per call at the timing size
    linear_share: float  # of the model's FLOPs
    rounds: int
    int8_rate_gflops: float | None = None  # oneDNN's int8 linear at the same shapes, where it was raced

    def _clear(self, ratio: float) -> bool:
        return self.linear_gflop >= MIN_GFLOP and self.linear_share >= LINEAR_SHARE and ratio >= FASTER_BY

    @property
    def ratio(self) -> float:
        return self.rate_gflops / self.fp32_rate_gflops

    @property
    def int8_ratio(self) -> float | None:
        """int8's rate over the fastest float precision raced (float32's, in a race of int8 itself)."""
        if self.precision == "int8":
            return self.ratio
        return None if self.int8_rate_gflops is None else self.int8_rate_gflops / self.rate_gflops

    @property
    def int8_against(self) -> tuple[str, float, float]:
        """The float precision int8 was raced against, int8's rate and that precision's."""
        if self.precision == "int8":
            return "float32", self.rate_gflops, self.fp32_rate_gflops
        return self.precision, self.int8_rate_gflops or 0.0, self.rate_gflops

    def fp32_cannot_win(self) -> bool:
        # int8 is no reason to skip float32: it may miss the accuracy (and is raced after the float32 groups)
        return self.precision != "int8" and self._clear(self.ratio)

    def int8_ahead(self) -> bool:
        """Whether int8 products clearly outrun the reduced precision's, where the model spends its work."""
        return self.int8_ratio is not None and self._clear(self.int8_ratio)

    def to_json(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "rate_gflops": round(self.rate_gflops, 1),
            "fp32_rate_gflops": round(self.fp32_rate_gflops, 1),
            "ratio": round(self.ratio, 3),
            "linear_gflop": round(self.linear_gflop, 3),
            "linear_share": round(self.linear_share, 3),
            "rounds": self.rounds,
            "int8_rate_gflops": None if self.int8_rate_gflops is None else round(self.int8_rate_gflops, 1),
            "int8_ratio": None if self.int8_ratio is None else round(self.int8_ratio, 3),
            "rule": {"faster_by": FASTER_BY, "linear_share": LINEAR_SHARE, "min_gflop": MIN_GFLOP},
        }


def skip_reason(race: PrecisionRace, passed: str) -> str:
    """The float32 rows' reason when ``race`` says they cannot win and ``passed`` kept the spec."""
    return (
        f"cannot win here: {race.precision} products ran {race.ratio:.2f}× float32's at this model's linear "
        f"shapes ({race.rate_gflops:.0f} vs {race.fp32_rate_gflops:.0f} GFLOP/s, median of {race.rounds} "
        f"interleaved rounds; {race.linear_share:.0%} of its FLOPs) and {passed} kept your accuracy "
        "(--keep all writes it anyway)"
    )


def int8_probe_reason(race: PrecisionRace) -> str:
    """Why the speed gate does not compile the all-int8 package, when ``race.int8_ahead()``."""
    against, int8_rate, rate = race.int8_against
    return (
        f"int8 products ran {race.int8_ratio:.2f}× {against}'s at this model's linear shapes "
        f"({int8_rate:.0f} vs {rate:.0f} GFLOP/s; {race.linear_share:.0%} of its FLOPs): "
        "the all-int8 package was not compiled to ask, and the search runs"
    )


def run_race(roofline: Roofline, precision: str, batch: int, rounds: int = ROUNDS) -> PrecisionRace | None:
    """Measure ``precision`` against float32 (and int8, where the roofline was made for it and can measure
    it here) at ``roofline``'s linear shapes (counted at batch 1, scaled to ``batch``); None where either
    of the first two cannot be measured here or the model calls no ``nn.Linear``."""
    if not roofline.flops or {"fp32", precision} - set(roofline.precisions):
        return None
    raced = ("fp32", precision, "int8")
    peaks = [p for p in roofline.between(batch) if p.precision in raced]
    for _ in range(rounds):
        for peak in peaks:
            peak()
    for peak in peaks:
        peak.release()
    rate = {p.precision: p.spread().median for p in peaks}
    linear = sum(s.flops for s in roofline.shapes)
    return PrecisionRace(
        precision=precision,
        rate_gflops=rate[precision],
        fp32_rate_gflops=rate["fp32"],
        linear_gflop=linear * batch / 1e9,
        linear_share=min(1.0, linear / roofline.flops),
        rounds=rounds,
        int8_rate_gflops=rate.get("int8") if precision != "int8" else None,
    )
