"""The precision race: which precisions can still win, from their matrix products at the model's shapes.

Before the first candidate group is written, the rates of float32, each reduced float precision among
the candidates and int8 are measured at the model's own linear shapes at the timing size
(``tk.measure.roofline``'s ``ShapePeak``: oneDNN-packed, as the packages run them), interleaved, about
3 s for the small Transformer at 32 x 128. Three rules read them, each only where the products carry
most of the model's FLOPs and a call is large enough for a rate to mean something:

- a reduced float precision whose products run under ``OUTRUNS_BY`` float32's cannot win: float32 runs
  as fast and loses nothing, so its groups are skipped. A CPU flag does not say this: on an Intel Xeon
  with AVX512-BF16 and no AMX, bf16 products ran 0.65-0.70x float32's and the bf16 packages 0.7x the
  float32 ones, where on the AVX512-BF16 AMD EPYC they ran about 2x (benchmarks/history.md);
- once a reduced float candidate keeps the user's accuracy, the float32 groups (four formats and the
  unfused onnx graph: about a quarter of a small Transformer's run) are skipped when its products run
  at least ``FASTER_BY`` float32's (interleaved p50s of one model in two formats differ by 1-4% on our
  machines; the small Transformer's bf16 package ran 2.4x the best float32 candidate where the rates
  differed 1.95x);
- where int8 products run at least ``FASTER_BY`` the fastest float precision still in the race, the
  speed gate does not compile the aoti all-int8 package to ask whether int8 can win (about 30 s of the
  small Transformer's run): its answer there was always yes (the all-int8 package 1.35-1.43x the bf16
  package's speed where the products differed 1.58x on the AVX512-BF16 EPYC; 1.6-1.8x float32's on the
  AVX512-VNNI Xeons), and a wrong yes costs only a search, never the winner;
- where that fastest float precision is float32 itself (no reduced float can win), the aoti int8 group
  is written before the float32 groups, and once it keeps the user's accuracy the float32 groups are
  skipped when Amdahl's law, from the share of the linears' multiply-adds it kept in int8 and the rates,
  says it runs at least ``FASTER_BY`` float32's: ``1 / ((1 - L) + L (s / r + 1 - s))`` with L the
  products' share of the FLOPs, s the int8 share and r int8's rate over float32's. The law counts the
  non-product work at float32's speed, and from the rates of five runs it gave 2.2-2.6x on the Xeon
  without AMX where the package ran 2.0x the fastest float32 candidate. int8 that misses the accuracy skips nothing.

A reduced float precision none of whose candidates passed (they missed the user's accuracy, or could not
be written or run) leaves the race (``PrecisionRace.without``): it cannot win either, so the last two
rules are read again against the fastest float precision still in it, before the groups left are written. On a model bf16 moves past the
accuracy (the small Transformer trained to a steep decision boundary, on the AVX512-BF16 EPYC), int8
then leads float32: the aoti int8 group goes before the float32 ones and its probe is not compiled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tk.formats.products import OUTRUNS_BY

if TYPE_CHECKING:
    from tk.measure.roofline import Roofline

FASTER_BY = 1.5  # a rate over another's that decides a skip
LINEAR_SHARE = 0.8  # of the model's FLOPs in its linear products
MIN_GFLOP = 1.0  # per call at the timing size: below it per-call overheads, not products, decide
ROUNDS = 7
FLOATS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class PrecisionRace:
    """Each raced precision's median rate at the model's linear shapes, and how much of the model's
    work those shapes are."""

    rates: dict[str, float] = field(default_factory=dict)  # precision -> GFLOP/s (GOP/s for int8)
    linear_gflop: float = 0.0  # per call at the timing size
    linear_share: float = 0.0  # of the model's FLOPs
    rounds: int = ROUNDS
    # reduced float precisions out of the race: none of their candidates passed (``tk optimize``'s rows)
    out: frozenset[str] = frozenset()

    def without(self, precision: str) -> PrecisionRace:
        """This race with ``precision`` out of it (none of its candidates passed)."""
        return dataclasses.replace(self, out=self.out | {precision})

    def decides(self) -> bool:
        """Whether the rates can decide anything: most of the model's work, and enough of it, is products."""
        return self.linear_gflop >= MIN_GFLOP and self.linear_share >= LINEAR_SHARE

    def ratio(self, precision: str, against: str = "fp32") -> float | None:
        if precision not in self.rates or against not in self.rates:
            return None
        return self.rates[precision] / self.rates[against]

    def no_gain(self, precision: str) -> bool:
        """Whether reduced float ``precision`` cannot win: its products run under ``OUTRUNS_BY`` float32's."""
        ratio = self.ratio(precision) if precision in FLOATS[1:] else None
        return ratio is not None and self.decides() and ratio < OUTRUNS_BY

    def fp32_cannot_win(self, passed: str) -> bool:
        """Whether float32 cannot win once a ``passed`` (reduced float) candidate kept the accuracy."""
        ratio = self.ratio(passed) if passed in FLOATS[1:] else None
        return ratio is not None and self.decides() and ratio >= FASTER_BY

    def fastest_float(self) -> str:
        """The float precision with the highest rate, among those that may win."""
        floats = [p for p in FLOATS if p in self.rates and not self.no_gain(p) and p not in self.out]
        return max(floats, key=self.rates.__getitem__, default="fp32")

    def int8_ahead(self) -> bool:
        """Whether int8 products clearly outrun the fastest float precision's, where the model spends its work."""
        ratio = self.ratio("int8", self.fastest_float())
        return ratio is not None and self.decides() and ratio >= FASTER_BY

    def int8_leads(self) -> bool:
        """Whether int8 is ahead and float32 is the fastest float precision that may win: the aoti int8
        group then goes before the float32 groups, which a passing int8 candidate may skip."""
        return self.int8_ahead() and self.fastest_float() == "fp32"

    def int8_speedup(self, share: float) -> float | None:
        """What Amdahl's law gives an int8 model with ``share`` of its linears' multiply-adds in int8 over
        the float32 one: the products (``linear_share`` of the FLOPs) at the two rates, the rest as is."""
        ratio = self.ratio("int8")
        if ratio is None:
            return None
        products = self.linear_share * (share / ratio + 1 - share)
        return 1 / ((1 - self.linear_share) + products)

    def fp32_loses_to_int8(self, share: float) -> bool:
        """Whether float32 cannot win once an int8 candidate with ``share`` in int8 kept the accuracy."""
        speedup = self.int8_speedup(share)
        return speedup is not None and self.int8_leads() and speedup >= FASTER_BY

    def products_gap_ms(self) -> float | None:
        """How much longer the model's linears take per call at float32's rate than at int8's (ms)."""
        if "int8" not in self.rates or "fp32" not in self.rates:
            return None
        return self.linear_gflop * (1 / self.rates["fp32"] - 1 / self.rates["int8"]) * 1e3

    def to_json(self) -> dict[str, Any]:
        return {
            "rates_gflops": {p: round(r, 1) for p, r in self.rates.items()},
            "over_fp32": {p: round(r, 3) for p in self.rates if p != "fp32" and (r := self.ratio(p)) is not None},
            "linear_gflop": round(self.linear_gflop, 3),
            "linear_share": round(self.linear_share, 3),
            "rounds": self.rounds,
            "out": sorted(self.out),
            "rule": {
                "outruns_by": OUTRUNS_BY, "faster_by": FASTER_BY, "linear_share": LINEAR_SHARE, "min_gflop": MIN_GFLOP,
            },
        }  # fmt: skip


def _rates(race: PrecisionRace, precision: str, against: str) -> str:
    unit = "GOP/s" if "int8" in (precision, against) else "GFLOP/s"
    return (
        f"{race.ratio(precision, against):.2f}× {_named(against)}'s at this model's linear shapes "
        f"({race.rates[precision]:.0f} vs {race.rates[against]:.0f} {unit}, median of {race.rounds} interleaved "
        f"rounds; {race.linear_share:.0%} of its FLOPs)"
    )


def _named(precision: str) -> str:
    return "float32" if precision == "fp32" else precision


def no_gain_reason(race: PrecisionRace, precision: str) -> str:
    """A reduced float row's reason when ``race.no_gain(precision)``."""
    return (
        f"cannot win here: {precision} products ran {_rates(race, precision, 'fp32')}, under the "
        f"{OUTRUNS_BY}× it would need: float32 runs as fast and loses nothing (--keep all writes it anyway)"
    )


def skip_reason(race: PrecisionRace, passed: str, precision: str) -> str:
    """The float32 rows' reason when ``race.fp32_cannot_win(precision)`` and candidate ``passed`` kept the spec."""
    return (
        f"cannot win here: {precision} products ran {_rates(race, precision, 'fp32')} and {passed} kept your "
        "accuracy (--keep all writes it anyway)"
    )


def int8_skip_reason(race: PrecisionRace, passed: str, share: float) -> str:
    """The float32 rows' reason when ``race.fp32_loses_to_int8(share)`` and int8 candidate ``passed`` kept the spec."""
    return (
        f"cannot win here: {passed} kept your accuracy with {share:.0%} of the linears' multiply-adds in int8, "
        f"and int8 products ran {_rates(race, 'int8', 'fp32')}: by Amdahl's law about "
        f"{race.int8_speedup(share):.2f}× float32's speed, over the {FASTER_BY}× this needs (--keep all writes it anyway)"
    )


def int8_probe_reason(race: PrecisionRace) -> str:
    """Why the speed gate does not compile the all-int8 package, when ``race.int8_ahead()``."""
    return (
        f"int8 products ran {_rates(race, 'int8', race.fastest_float())}: the all-int8 package was not "
        "compiled to ask, and the search runs"
    )


def run_race(roofline: Roofline, batch: int, rounds: int = ROUNDS) -> PrecisionRace | None:
    """Measure every precision ``roofline`` was made for and can measure here, at its linear shapes
    (counted at batch 1, scaled to ``batch``); None where float32 cannot be measured or the model
    runs no linear product."""
    if not roofline.flops or "fp32" not in roofline.precisions:
        return None
    peaks = roofline.between(batch, floors=False)  # the rates alone
    for _ in range(rounds):
        for peak in peaks:
            peak()
    for peak in peaks:
        peak.release()
    linear = sum(s.flops for s in roofline.shapes)
    return PrecisionRace(
        rates={p.precision: p.spread().median for p in peaks},
        linear_gflop=linear * batch / 1e9,
        linear_share=roofline.linear_share,
        rounds=rounds,
    )


def linear_int8_share(module: Any, excluded: list[str]) -> float | None:
    """The share of ``module``'s linear multiply-adds per row (in x out features) outside the ``excluded``
    module paths (a path excludes every linear under it); None where it has no linear. Linears are the
    ``nn.Linear`` modules and each ``nn.MultiheadAttention``'s input projection, a weight of its own that its
    forward multiplies by (under the attention's path, as the int8 writers name it)."""
    from torch import nn

    sizes: dict[str, int] = {}
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            sizes[name] = m.in_features * m.out_features
        elif isinstance(m, nn.MultiheadAttention):
            weights = (
                [m.in_proj_weight]
                if m.in_proj_weight is not None
                else [m.q_proj_weight, m.k_proj_weight, m.v_proj_weight]
            )
            sizes[name] = sum(w.numel() for w in weights)
    total = sum(sizes.values())
    if not total:
        return None
    out = sum(n for name, n in sizes.items() if any(name == e or name.startswith(e + ".") for e in excluded))
    return 1 - out / total
