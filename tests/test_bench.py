"""The benchmark library: rows, percentiles, speed-ups and the files it writes (never timings)."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from tk.measure.hardware import machine_description
from tk.measure.load_guard import OTHERS_ALONE_BUSY_CORES, OTHERS_BUSY_CORES, LoadGuard
from tk.runtime import load
from tk.workflows.bench import BenchReport, measure, render_table, save_json, save_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def engines(exported):
    dynamic = exported("transformer", ("torch",)).root
    static = exported("transformer", ("torch",), dynamic=False).root
    opened = {"eager": load(dynamic, "eager"), "torch": load(dynamic, "torch"), "static": load(static, "torch")}
    yield opened
    for engine in opened.values():
        engine.close()


@pytest.fixture(scope="module")
def report(engines) -> BenchReport:
    return measure({"eager": engines["eager"], "torch": engines["torch"]}, [1, 4], iters=5, warmup=1)


def test_one_row_per_engine_and_batch_size(report):
    assert [(r.engine, r.batch_size, r.iters) for r in report.rows] == [
        ("eager", 1, 5),
        ("torch", 1, 5),
        ("eager", 4, 5),
        ("torch", 4, 5),
    ]
    for row in report.rows:
        assert 0 < row.p50_ms <= row.p90_ms <= row.p99_ms
        assert row.throughput == pytest.approx(row.batch_size / (row.p50_ms / 1e3))
    for size in (1, 4):
        eager, torch_row = (r for r in report.rows if r.batch_size == size)
        assert eager.speedup == pytest.approx(1.0)
        assert torch_row.speedup == pytest.approx(eager.p50_ms / torch_row.p50_ms)
    assert report.skipped == []
    assert report.settings["sizes"] == {"seq": 16}


def test_batch_sizes_outside_an_engine_range_are_skipped(engines):
    report = measure({"torch": engines["torch"], "static": engines["static"]}, [1, 8], iters=2, warmup=0)
    assert [(r.engine, r.batch_size) for r in report.rows] == [("torch", 1), ("torch", 8), ("static", 8)]
    assert all(r.speedup is None for r in report.rows)  # no eager engine
    assert [(s["engine"], s["batch_size"]) for s in report.skipped] == [("static", 1)]
    assert "'batch'" in report.skipped[0]["reason"] and "[8, 8]" in report.skipped[0]["reason"]


def test_a_time_budget_still_gives_a_few_calls(engines):
    messages: list[str] = []
    report = measure(
        {"eager": engines["eager"]}, [2], seconds=0.001, sizes={"seq": 8}, warmup=0, progress=messages.append
    )
    assert report.rows[0].iters >= 3
    assert report.settings["sizes"]["seq"] == 8
    assert any("warm-up" in m for m in messages) and any("p50" in m for m in messages)


def test_json_table_and_plot(report, tmp_path):
    save_json(report, tmp_path / "bench.json")
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [row["engine"] for row in data["results"]["rows"]] == ["eager", "torch", "eager", "torch"]
    assert data["results"]["rows"][0]["p50_ms"] == report.rows[0].p50_ms
    assert {"cpu", "cores", "torch_threads", "gpu"} <= set(data["machine"])
    assert data["command"] == "tk bench" and data["versions"]["torch"] == torch.__version__
    assert data["settings"]["batch_sizes"] == [1, 4] and set(data["load_average"]) == {"before", "after"}

    save_plot(report, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_MAGIC

    console = Console(record=True, width=160)
    console.print(render_table(report))
    text = console.export_text()
    assert "eager" in text and "torch" in text and "1.00×" in text


def test_machine_description_names_versions():
    machine = machine_description()
    assert machine["versions"]["torch"] == torch.__version__
    assert machine["cpu"] and machine["platform"]
    assert machine["torch_threads"] == torch.get_num_threads()
    assert machine["cores"] >= 1


def test_table_warns_about_a_busy_machine():
    machine = {"cpu": "test", "torch_threads": 2, "load_average": [5.0, 4.0, 3.0], "cores": 2}
    console = Console(record=True, width=160)
    console.print(render_table(BenchReport([], machine, {})))
    assert "busy machine: load average 5.0 on 2 cores" in console.export_text()


@pytest.mark.parametrize("io", ["host", "device"])
def test_io_modes_time_the_cold_call_apart_and_record_it(engines, io):
    calls = []
    engine = engines["torch"]
    inner = engine.run

    def counting_run(feeds, check=True):
        calls.append((type(next(iter(feeds.values()))).__name__, check))
        return inner(feeds, check=check)

    engine.run = counting_run
    try:
        result = measure({"torch": engine}, [2], iters=4, warmup=2, io=io)
    finally:
        del engine.run
    (row,) = result.rows
    assert row.io == io and result.settings["io"] == io and result.settings["warmup"] == 2
    assert row.iters == 4 and row.cold_ms is not None and row.cold_ms > 0
    # on the CPU there are no copies to split out and no GPU memory
    assert row.h2d_ms is row.compute_ms is row.d2h_ms is row.peak_gpu_mb is None
    # 1 cold + 2 warm-up + 4 timed calls, all with the checks skipped (the feeds were checked once)
    assert calls == [("Tensor" if io == "device" else "ndarray", False)] * 7
    assert json.loads(json.dumps(result.to_json()))["results"]["rows"][0]["cold_ms"] == row.cold_ms


def test_bad_io_or_warmup_is_refused(engines):
    from tk.errors import UsageError

    with pytest.raises(UsageError, match="--io: expected one of host, device"):
        measure({"torch": engines["torch"]}, [1], iters=1, io="pinned")
    with pytest.raises(UsageError, match="--warmup: expected 0 or more"):
        measure({"torch": engines["torch"]}, [1], iters=1, warmup=-1)


def test_no_baselines_times_only_the_engines_asked_for(exported, tmp_path):
    from click.testing import CliRunner

    from tk.cli import cli

    root = exported("mlp", ("torch",)).root
    out = tmp_path / "b.json"
    args = [
        "bench",
        str(root),
        "--engine",
        "torch",
        "--no-baselines",
        "--roofline",
        "--iters",
        "2",
        "--batch-sizes",
        "2",
        "--wait-quiet",
        "0.01",
    ]
    result = CliRunner().invoke(cli, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.stderr
    data = json.loads(out.read_text())
    rows = data["results"]["rows"]
    assert [r["engine"] for r in rows] == ["torch"]  # eager only counted the FLOPs
    assert rows[0]["gflops"] > 0 and data["settings"]["roofline"]["flops_per_sample"] > 0
    assert rows[0]["peak_share"] is None and "too small to have a rate" in data["settings"]["roofline"]["no_share"]
    assert rows[0]["load_before"] is not None
    high = max(rows[0]["load_before"], rows[0]["load_after"]) > LoadGuard(0).cores
    others = rows[0]["others_cores"]  # a high load is busy only when other processes used the cores
    alone = others is not None and others > OTHERS_ALONE_BUSY_CORES  # (steal is not in the load average)
    assert data["settings"]["wait_quiet_s"] == 0.01 and rows[0]["busy"] is (
        alone or (high and (others is None or others > OTHERS_BUSY_CORES))
    )
    refused = CliRunner().invoke(cli, [*args[:-1], "-1"])
    assert refused.exit_code == 2 and "--wait-quiet" in refused.output


def test_rows_timed_on_a_busy_machine_are_marked_in_the_json_and_the_table(engines):
    readings = iter([9.0, 0.5, 0.5, 0.5])  # busy before batch 1; quiet around batch 2
    guard = LoadGuard(0, cores=2, read_load=lambda: next(readings), read_cpu=None)
    report = measure({"eager": engines["eager"]}, [1, 2], iters=2, warmup=0, guard=guard)
    assert [(r.batch_size, r.busy, r.load_before, r.load_after) for r in report.rows] == [
        (1, True, 9.0, 0.5),
        (2, False, 0.5, 0.5),
    ]
    assert [r["busy"] for r in report.to_json()["results"]["rows"]] == [True, False]
    console = Console(record=True, width=200)
    console.print(render_table(report))
    text = console.export_text()
    assert "9.0→0.5 busy" in text and "0.5→0.5" in text
    assert "busy machine: other work competed for the 2 cores while the rows marked busy were timed" in " ".join(
        text.split()
    )


def test_wait_quiet_is_refused_below_zero():
    from tk.errors import UsageError

    with pytest.raises(UsageError, match="--wait-quiet: expected 0 or more seconds"):
        LoadGuard(-1)


def test_a_bench_that_can_time_nothing_ends_with_exit_2(exported):
    from click.testing import CliRunner

    from tk.cli import cli

    root = exported("mlp", ("torch",)).root
    result = CliRunner().invoke(
        cli, ["bench", str(root), "--engine", "torch", "--batch-sizes", "100000", "--iters", "2"]
    )
    assert result.exit_code == 2, result.output
    last = [ln for ln in result.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("error: nothing could be timed: eager at batch 100000: input"), result.stderr
