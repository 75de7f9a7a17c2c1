"""Reading perf_analyzer's CSV report (no binary needed)."""

import csv

import pytest

from tk.serve.load.perf_analyzer import PHASE_COLUMNS, read_csv


def test_rows_come_back_by_concurrency_whatever_order_perf_analyzer_wrote(tmp_path):
    # perf_analyzer orders its rows by throughput: here concurrency 4 served less than 1 and came first
    header = ["Concurrency", "Inferences/Second", *PHASE_COLUMNS, "p50 latency", "p90 latency", "p99 latency"]
    written = [
        {"Concurrency": 4, "Inferences/Second": 350.5, "p50 latency": 11000, "p99 latency": 15000},
        {"Concurrency": 1, "Inferences/Second": 410.0, "p50 latency": 2400, "p99 latency": 3100},
    ]
    path = tmp_path / "perf_analyzer.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, header)
        writer.writeheader()
        for i, row in enumerate(written):
            writer.writerow({**dict.fromkeys(PHASE_COLUMNS, 100 * (i + 1)), "p90 latency": 0, **row})
    rows = read_csv(path)
    assert [r.concurrency for r in rows] == [1, 4]
    assert rows[0].inferences_per_s == 410.0 and rows[0].p50_ms == pytest.approx(2.4)
    assert rows[1].avg_ms == pytest.approx(7 * 100 / 1e3)  # the seven phases' sum, in ms
