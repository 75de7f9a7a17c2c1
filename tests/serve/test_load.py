"""The load test's scenarios (tk.serve.load.scenarios, tk.serve.load.report): requests, expected outputs,
the rows' and goals' arithmetic on made-up results. No timings judged. tk.serve.load.clients against a real
server is tested in test_triton_http.py, on that module's server."""

from __future__ import annotations

import os

import numpy as np
import pytest
from rich.console import Console

from tk.measure.load_guard import LoadGuard
from tk.runtime import load
from tk.serve.load.clients import LoadResult
from tk.serve.load.report import goals_line, render, serving_goals
from tk.serve.load.scenarios import (
    engine_batch_bound,
    engine_split_bound,
    expected_outputs,
    make_requests,
    mismatches,
    scenario_row,
)

MODEL = "transformer"


def test_requests_are_valid_and_mixed_ones_hold_one_to_four_samples(exported):
    art = exported("transformer", ("onnx",))
    mixed, single = make_requests(art.manifest.signature.inputs, 8, 12)
    assert len(mixed) == len(single) == 12 and {r["input_ids"].shape[1] for r in mixed + single} == {8}
    assert {len(r["input_ids"]) for r in single} == {1} and {len(r["input_ids"]) for r in mixed} <= {1, 2, 3, 4}
    assert len({len(r["input_ids"]) for r in mixed}) > 1


def test_expected_outputs_split_batched_calls_back_per_request(exported):
    art = exported("transformer", ("onnx",))
    mixed, _ = make_requests(art.manifest.signature.inputs, 8, 7)
    with load(art.root, "eager") as eager:
        expected = expected_outputs(eager, mixed, max_batch=5)
        alone = [eager.run(r)["logits"] for r in mixed]
    assert [e.shape for e in expected] == [a.shape for a in alone]
    assert max(float(np.abs(e - a).max()) for e, a in zip(expected, alone, strict=True)) < 1e-5


def test_scenario_rows_count_lost_duplicated_and_mismatched_replies():
    requests = [{"input_ids": np.zeros((n, 4), np.int64)} for n in (1, 2, 3)]
    expected = [np.full((n, 2), 1.0, np.float32) for n in (1, 2, 3)]
    result = LoadResult(
        replies={0: expected[0], 1: expected[1] + 0.5},  # request 2 lost, request 1 off by 0.5
        latencies={0: 0.010, 1: 0.030},
        failures={2: "TimeoutError: late"},
        duplicates=1,
        wall_s=0.5,
    )
    assert mismatches(result, expected, rtol=0.0, atol=1e-3) == (1, 0.5)
    row = scenario_row("mixed", True, requests, result, expected, 0.0, 1e-3)
    assert (row["lost"], row["duplicated"], row["mismatched"], row["max_abs_error"]) == (1, 1, 1, 0.5)
    assert row["samples"] == 6 and row["samples_per_s"] == 12.0 and row["requests_per_s"] == 4.0
    assert row["p50_ms"] == pytest.approx(20.0) and row["first_failure"] == "TimeoutError: late"
    assert scenario_row("single", False, requests, result)["mismatched"] is None


def test_engine_batch_bound_reports_both_sizes_and_the_load_mark(exported):
    art = exported("transformer", ("onnx",))
    guard = LoadGuard(0, cores=2, read_load=lambda: 0.5, read_cpu=None)
    bound = engine_batch_bound(art.root, art.manifest.signature.inputs, 8, 4, 1, guard, rounds=2)
    assert bound["max_batch"] == 4 and bound["batch1_samples_per_s"] > 0 and bound["max_batch_samples_per_s"] > 0
    assert bound["gain"] == pytest.approx(bound["max_batch_samples_per_s"] / bound["batch1_samples_per_s"])
    assert bound["busy"] is False and bound["load_before"] == 0.5


def test_engine_split_bound_runs_one_engine_a_process_side_by_side(exported):
    """The workers are reaped inside the row, so their CPU counts as this run's own, never as another
    process's: the row's last reading of this process's CPU already holds theirs. The readings are of this
    process alone (a machine where nothing else runs), so the verdict does not depend on what does."""
    art = exported("transformer", ("onnx",))
    own_readings: list[float] = []

    def own_cpu() -> tuple[float, float]:
        times = os.times()  # reaped children's CPU included
        own_readings.append(times.user + times.system + times.children_user + times.children_system)
        return own_readings[-1], own_readings[-1]

    before = os.times()
    split = engine_split_bound(art.root, 8, 4, 2, LoadGuard(0, cores=2, read_load=lambda: 0.5, read_cpu=own_cpu), 0.5)
    after = os.times()
    assert (split["processes"], split["threads_each"], split["max_batch"]) == (2, 1, 4)
    assert split["samples_per_s"] > 0 and split["load_before"] == 0.5
    workers_cpu = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    assert len(own_readings) == 2 and workers_cpu > 0
    assert own_readings[1] - own_readings[0] >= workers_cpu - 1e-6  # reaped before the row's end (sums of floats)
    assert split["others_cores"] == 0.0 and split["busy"] is False


def test_goals_and_table_read_the_rows():
    load_mark = {"load_before": 0.5, "load_after": 0.7, "busy": False}
    common = {"requests": 4, "lost": 0, "duplicated": 0, "mismatched": None, "p50_ms": 2.0, **load_mark}
    rows = [
        {"scenario": "single", "batching": True, "samples_per_s": 300.0, "p99_ms": 6.0, **common},
        {"scenario": "single", "batching": False, "samples_per_s": 100.0, "p99_ms": 3.0, **common},
        {"scenario": "one client", "batching": False, "samples_per_s": 50.0, "p99_ms": 3.0, **common,
         "engine_p50_ms": 1.5, "overhead_p50_ms": 0.5, "health_p50_ms": 0.2, "busy": True},
    ]  # fmt: skip
    goals = serving_goals(rows, {"gain": 4.0, "max_batch_samples_per_s": 400.0})
    assert goals["single_throughput_ratio"] == 3.0 and goals["single_p99_on_over_p50_off"] == 3.0
    assert goals["served_over_engine_best"] == 0.75  # 300 served / 400 by the engine alone at its largest batch
    assert goals["overhead_ms"] == 0.5 and goals["engine_batching_bound"] == 4.0
    assert "perf_analyzer_overhead_ms" not in goals  # no perf_analyzer rows: the Python client's overhead only
    pa = {"client": "perf_analyzer", "concurrency": 1, "scenario": "single c=1", "samples_per_s": 90.0, **common}
    with_pa = serving_goals(
        [*rows, pa | {"batching": True, "overhead_avg_ms": 0.3}, pa | {"batching": False, "overhead_avg_ms": 0.4}],
        {"gain": 4.0, "max_batch_samples_per_s": 400.0},
    )
    assert with_pa["perf_analyzer_overhead_ms"] == 0.4  # the larger of batching on and off
    assert with_pa["perf_analyzer_overhead_by_batching"] == {"on": 0.3, "off": 0.4}
    assert "0.40 ms through perf_analyzer" in goals_line(with_pa, 8) and "batching on 0.30, off 0.40" in goals_line(
        with_pa, 8
    )
    split = serving_goals(rows, {"gain": 4.0, "max_batch_samples_per_s": 400.0, "best_samples_per_s": 600.0})
    assert split["served_over_engine_best"] == 0.5  # against 1-thread engines side by side, where they do better
    console = Console(record=True, width=200)
    console.print(render(rows, "tiny"))
    assert console.export_text().count("busy") == 1
