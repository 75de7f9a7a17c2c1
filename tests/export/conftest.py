"""What the per-format export tests share: the export-time check's report, and runs compared with eager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tk.manifest import Manifest
from tk.spec import random_feeds
from tk.tolerances import tolerance_for


def passed_check(manifest: Manifest, fmt: str) -> dict[str, Any]:
    """``fmt``'s export-time check report, asserted passed at two shapes or more, every output within 1e-4."""
    assert manifest.status == "passed", manifest.check
    report = manifest.check[fmt]
    assert report["passed"] and len(report["shapes"]) >= 2, report  # across the dynamic range, not the example alone
    for out in report["outputs"]:
        assert out["passed"] and out["max_abs"] < 1e-4, out
    return report


@pytest.fixture(scope="session")
def run_against_eager(eager_outputs: Callable[..., Any], close: Callable[..., Any]) -> Callable[..., dict[str, float]]:
    """``run_against_eager(engine, e, sizes, seed)``: run ``engine`` on random inputs at ``sizes`` and assert its
    outputs within the fp32 tolerance (``e``'s model overrides) of ``e``'s PyTorch model; the errors per output."""

    def run(engine: Any, e: Any, sizes: dict[str, int], seed: int) -> dict[str, float]:
        feeds = random_feeds(engine.inputs, sizes, seed=seed)
        expected = eager_outputs(e.spec, feeds)
        return close(engine.run(feeds), expected, *tolerance_for("fp32", model_overrides=e.spec.tolerances))

    return run
