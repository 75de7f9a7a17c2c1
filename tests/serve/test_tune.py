"""``tk serve --config`` settings files and ``tk serve --tune``: the settings' checks and the
recommendation's logic without Ray, then a tiny real tune (2 x 1 x 1 grid) whose file ``tk serve
--config`` serves. No speed is asserted: the tune's numbers are whatever this machine gives."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.request

import pytest

from tests.serve.conftest import ROOT
from tk.errors import UsageError
from tk.serve.config import apply_settings, read_settings, write_settings
from tk.serve.load.tune import (
    TuneGrid,
    TunePoint,
    TuneResult,
    grid_points,
    parse_range,
    recommend,
    recommended_settings,
)


def test_settings_round_trip_and_refusals(tmp_path):
    path = tmp_path / "serve.json"
    write_settings(path, {"max_batch": 8, "max_delay_ms": 2.0, "replicas": 2, "batching": True})
    assert read_settings(path) == {"max_batch": 8, "max_delay_ms": 2.0, "replicas": 2, "batching": True}
    cases = {
        '{"max_batch": 8, "colour": 1}': "unknown setting 'colour'",
        '{"max_batch": "8"}': 'max_batch: expected int, got "8"',
        '{"batching": 1}': "batching: expected bool, got 1",
        '{"replicas": true}': "replicas: expected int, got true",
        "[1, 2]": "expected a JSON object of settings, got list",
        '{"max_batch": ': "expected JSON, got an error at line 1",
    }
    for text, fragment in cases.items():
        path.write_text(text)
        with pytest.raises(UsageError, match="--config .*" + fragment.replace("(", r"\(")):
            read_settings(path)
    with pytest.raises(UsageError, match="readable JSON file"):
        read_settings(tmp_path / "missing.json")
    path.write_bytes(b"\x89PNG\r\n\x1a\n")  # a file that is no text
    with pytest.raises(UsageError, match=r"--config .*expected a UTF-8 JSON file of settings, got 'utf-8' codec"):
        read_settings(path)
    for text, shown in (("NaN", "NaN"), ("1e400", "Infinity"), ("1" + "0" * 400, "an integer of over 30 digits")):
        path.write_text('{"max_delay_ms": ' + text + "}")
        with pytest.raises(UsageError, match=f"--config .*max_delay_ms: expected a finite float, got {shown}"):
            read_settings(path)
    assert read_settings(_write(tmp_path, {"max_delay_ms": 3})) == {"max_delay_ms": 3.0}  # an int is a float


def _write(tmp_path, data):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    return path


def test_grid_skips_what_the_cpus_cannot_hold_and_is_bounded():
    points = grid_points(TuneGrid([1, 8], [1.0], [1, 2, 3]), cpus=2, cpus_per_replica=1.0)
    assert [(p.replicas, p.max_batch) for p in points] == [(1, 1), (1, 8), (2, 1), (2, 8), (3, 1), (3, 8)]
    assert [p.skipped for p in points][:4] == [None] * 4
    assert points[4].skipped == "3 x 1 CPUs > 2"
    with pytest.raises(UsageError, match="at most 64 points"):
        grid_points(TuneGrid(list(range(1, 66)), [1.0], [1]), cpus=2, cpus_per_replica=1.0)
    with pytest.raises(UsageError, match="--tune grid"):
        grid_points(TuneGrid([0], [1.0], [1]), cpus=2, cpus_per_replica=1.0)


def test_a_max_batch_of_one_is_tried_at_the_smallest_delay_only():
    points = grid_points(TuneGrid([1, 8], [5.0, 0.0], [1]), cpus=2, cpus_per_replica=1.0)
    assert [(p.max_batch, p.max_delay_ms) for p in points] == [(1, 0.0), (8, 5.0), (8, 0.0)]


def test_with_requests_of_several_samples_a_max_batch_of_one_is_batching_off_and_smaller_batches_are_skipped():
    points = grid_points(TuneGrid([1, 2, 4, 8], [5.0, 0.0], [1]), cpus=2, cpus_per_replica=1.0, largest=4)
    rows = [(p.max_batch, p.max_delay_ms, p.batching, p.skipped) for p in points]
    assert rows == [
        (4, 0.0, False, None),  # each request alone; the max batch takes the largest request
        (2, 5.0, True, "below the largest request (4 samples)"),
        (2, 0.0, True, "below the largest request (4 samples)"),
        (4, 5.0, True, None),
        (4, 0.0, True, None),
        (8, 5.0, True, None),
        (8, 0.0, True, None),
    ]
    assert points[0].settings()["batching"] is False
    single = grid_points(TuneGrid([1, 8], [0.0], [1]), cpus=2, cpus_per_replica=1.0)
    assert [(p.max_batch, p.batching) for p in single] == [(1, True), (8, True)]


def test_tune_samples_and_seq_are_n_or_a_range():
    assert parse_range("--tune-samples", "1") == (1, 1) and parse_range("--tune-seq", "16-128") == (16, 128)
    assert parse_range("--tune-samples", " 3-3 ") == (3, 3)
    for text in ("0", "4-1", "a", "1-2-3", "", "-1"):
        with pytest.raises(UsageError, match=f"--tune-seq: expected N or A-B with 1 <= A <= B, got {text!r}"):
            parse_range("--tune-seq", text)


def test_tune_seq_lengths_are_seeded_within_the_range_and_checked_against_the_artifact():
    from tk.serve.load.tune import _lengths
    from tk.spec import Dim, Signature

    sig = Signature([], [], {"batch": Dim("batch", 1, 8, 32), "seq": Dim("seq", 8, 64, 128)})
    lengths = _lengths(sig, (16, 128), 200)
    assert min(lengths) >= 16 and max(lengths) <= 128 and len(set(lengths)) > 50
    assert lengths == _lengths(sig, (16, 128), 200)  # the same requests at every point and every run
    with pytest.raises(UsageError, match="--tune-seq 4-128: this artifact takes sequences of 8 to 128"):
        _lengths(sig, (4, 128), 10)
    with pytest.raises(UsageError, match="--tune-seq: this artifact has no seq dimension \\(its dimensions: batch\\)"):
        _lengths(Signature([], [], {"batch": Dim("batch", 1, 8, 32)}), (16, 16), 10)


def test_the_tune_table_says_what_was_sent():
    from tk.cli.serve_tuning import _traffic

    assert _traffic((1, 1), None) == "single-sample requests"
    assert _traffic((1, 4), (16, 128)) == "requests of 1-4 samples, 16-128 tokens"
    assert _traffic((2, 2), (64, 64)) == "requests of 2 samples, 64 tokens"


def test_a_grid_above_the_artifacts_batch_max_is_refused_before_ray_starts(exported):
    from tk.runtime import EngineChoice
    from tk.serve.config import ServeConfig
    from tk.serve.load.tune import tune

    art = exported("transformer", ("onnx",))  # batch max 64
    base = ServeConfig(str(art.root), engine=EngineChoice("onnx"))
    with pytest.raises(UsageError, match="no point fits this machine's CPUs and this artifact's batch max"):
        tune(base, TuneGrid([128, 256], [0.0], [1]), p99_ms=100, cpus=2)
    with pytest.raises(UsageError, match="--tune-samples 1-65: this artifact's batch max is 64"):
        tune(base, TuneGrid([8], [0.0], [1]), p99_ms=100, cpus=2, samples=(1, 65))


def test_tune_refuses_a_cluster_address_and_counts_replicas_of_no_cpus_as_whole_ones(exported):
    from click.testing import CliRunner

    from tk.cli import cli
    from tk.cli.serve_tuning import _share

    art = exported("transformer", ("onnx",))
    result = CliRunner().invoke(cli, ["serve", str(art.root), "--tune", "--address", "ray://10.0.0.1:10001"])
    assert result.exit_code == 2 and "--tune: expected a local Ray instance of its own" in result.stderr, result.stderr
    assert _share(0.0) == 1.0 and _share(0.5) == 0.5  # --cpus-per-replica 0: replicas 1..cpus, not 1..2e9


def test_the_settings_written_carry_the_best_points_batching():
    off = TunePoint(
        2, 4, 0.0, requests=10, samples_per_s=50.0, p50_ms=1.0, p99_ms=2.0, engine_threads=1, batching=False
    )
    on = TunePoint(2, 8, 0.0, requests=10, samples_per_s=40.0, p50_ms=1.0, p99_ms=2.0, engine_threads=1)
    best, within = recommend([on, off], p99_ms=10)
    assert best is off and within
    from tk.runtime import EngineChoice
    from tk.serve.config import ServeConfig

    base = ServeConfig("art", engine=EngineChoice("onnx"), cpus_per_replica=1.0)
    settings = recommended_settings(TuneResult([on, off], best, within, 10.0, 2, (1, 4)), base)
    assert settings == {
        "replicas": 2, "max_batch": 4, "max_delay_ms": 0.0, "batching": False, "engine_threads": 1,
        "cpus_per_replica": 1.0,
    }  # fmt: skip
    assert apply_settings(base, settings).batching is False


def test_each_point_splits_the_cpus_among_its_replicas_unless_threads_are_given(tmp_path):
    from tk.runtime import EngineChoice
    from tk.serve.config import ServeConfig

    points = grid_points(TuneGrid([8], [1.0], [1, 2, 3]), cpus=4, cpus_per_replica=1.0)
    assert [(p.replicas, p.engine_threads) for p in points] == [(1, 4), (2, 2), (3, 1)]
    assert points[1].settings() == {
        "replicas": 2, "max_batch": 8, "max_delay_ms": 1.0, "batching": True, "engine_threads": 2,
    }  # fmt: skip
    fixed = grid_points(TuneGrid([8], [1.0], [1, 2]), cpus=4, cpus_per_replica=1.0, threads=3)
    assert [p.engine_threads for p in fixed] == [3, 3]
    path = tmp_path / "serve.json"
    write_settings(path, points[1].settings())
    assert read_settings(path)["engine_threads"] == 2
    base = ServeConfig("art", engine=EngineChoice("onnx", options={"threads": 4, "spinning": False}))
    config = apply_settings(base, read_settings(path))
    assert config.replicas == 2 and config.max_batch == 8
    assert dict(config.engine.options) == {"threads": 2, "spinning": False}
    assert apply_settings(base, {"replicas": 1}).engine is base.engine


def test_recommend_takes_the_fastest_within_budget_else_the_lowest_p99():
    def point(batch, per_s, p99, failed=0):
        return TunePoint(1, batch, 1.0, requests=10, failed=failed, samples_per_s=per_s, p50_ms=1.0, p99_ms=p99)

    points = [point(1, 100, 5), point(8, 300, 20), point(32, 500, 80), point(64, 900, 10, failed=1)]
    best, within = recommend(points, p99_ms=50)
    assert best is points[1] and within  # 500/s breaks the budget, 900/s had a failure
    assert [p.fits for p in points] == [True, True, False, False]
    best, within = recommend(points[:3], p99_ms=1)
    assert best is points[0] and not within
    assert recommend([TunePoint(1, 1, 1.0, skipped="budget")], 10) == (None, False)
    assert math.isnan(TunePoint(1, 1, 1.0).p99_ms)


@pytest.mark.slow
@pytest.mark.fits(seconds=120)
def test_tiny_tune_writes_a_config_that_serve_accepts(exported, tmp_path, serve_process):
    pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'tk[serve]')")
    pytest.importorskip("tritonclient.http", reason="needs tritonclient (pip install 'tk[serve]')")
    art = exported("transformer", ("onnx",))
    out = tmp_path / "tuned.json"
    tune = subprocess.run(
        [sys.executable, "-m", "tk", "serve", str(art.root), "--tune", "--tune-batch", "1,4", "--tune-delay-ms", "2",
         "--tune-replicas", "1", "--tune-requests", "24", "--tune-clients", "4", "--tune-samples", "1-3", "--tune-seq", "4-12",
         "--tune-budget-s", "240",
         "--p99-ms", "60000", "--threads", "1", "--tune-out", str(out)],
        cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert tune.returncode == 0, tune.stderr[-3000:]
    assert "<- best" in tune.stdout and f"wrote {out}" in tune.stdout, tune.stdout
    assert "requests of 1-3 samples, 4-12 tokens" in tune.stdout, tune.stdout
    settings = read_settings(out)
    # a max batch of 1 with requests of up to 3 samples: batching off, each request alone, a max batch of 3
    assert (settings["max_batch"], settings["batching"]) in ((3, False), (4, True)), settings
    assert settings["replicas"] == 1 and settings["max_delay_ms"] == 2.0
    assert settings["engine_threads"] == 1  # --threads 1 fixes every point's
    rows = [line for line in tune.stdout.splitlines() if "│" in line and ("yes" in line or "no" in line)]
    assert len(rows) == 2, tune.stdout  # both points ran (24 requests each, none failed: the budget is loose)
    assert sum(" off " in row for row in rows) == 1, tune.stdout
    from tests.serve.conftest import free_port

    port = free_port()
    with serve_process.running(str(art.root), "--config", str(out), "--max-delay-ms", "3", "--port", str(port)):
        line = serve_process.text()
        said = f"max batch {settings['max_batch']}, max delay 3 ms" if settings["batching"] else "no batching"
        assert said in line, line  # the file, and the flag wins
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/transformer/config", timeout=30) as reply:
            config = json.loads(reply.read())
        assert config["max_batch_size"] == settings["max_batch"]
        assert serve_process.infer_shape(port, settings["max_batch"]) == [settings["max_batch"], 2]
