"""The benchmarks' one result writer: the UTC-stamped file name and the envelope."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import torch

from tk.measure.results import BenchRun, jsonable


def test_file_names_carry_the_utc_start_and_the_command(tmp_path):
    started = dt.datetime(2026, 12, 1, 15, 4, 5, tzinfo=dt.timezone.utc)
    run = BenchRun("bench-cpu", {"seq": 128}, argv=["x"], started=started, machine={"cpu": "c"})
    assert run.path(tmp_path) == tmp_path / "20261201T150405Z-bench-cpu.json"
    assert run.path(tmp_path, ".png", "small") == tmp_path / "20261201T150405Z-bench-cpu-small.png"
    assert BenchRun("tk bench", started=started, machine={}).path("o").name == "20261201T150405Z-tk-bench.json"


def test_the_envelope_holds_command_argv_machine_versions_load_settings_and_results(tmp_path):
    run = BenchRun("bench-goals", {"out": Path("o"), "sizes": ("small",), "n": 3}, argv=["-m", "scripts.x", "--n", 3])
    path = run.write({"rows": [{"ms": 1.5}]}, tmp_path / "sub")
    assert path.parent == tmp_path / "sub" and path.name.endswith("Z-bench-goals.json")
    data = json.loads(path.read_text())
    assert set(data) == {
        "command", "argv", "started_utc", "finished_utc", "machine", "versions", "load_average", "settings", "results",
    }  # fmt: skip
    assert data["command"] == "bench-goals" and data["argv"] == ["-m", "scripts.x", "--n", "3"]
    assert data["settings"] == {"out": "o", "sizes": ["small"], "n": 3}
    assert data["results"] == {"rows": [{"ms": 1.5}]}
    assert data["versions"]["torch"] == torch.__version__ and "versions" not in data["machine"]
    assert data["machine"]["torch_threads"] == torch.get_num_threads()
    assert data["load_average"]["before"] == data["machine"]["load_average"]
    assert data["started_utc"].endswith("+00:00") and data["started_utc"] <= data["finished_utc"]
    assert list(tmp_path.glob("sub/*.tmp*")) == []


def test_an_explicit_path_is_written_as_given(tmp_path):
    run = BenchRun("tk bench", machine={"cpu": "c", "versions": {"torch": "t"}})
    assert run.write({}, path=tmp_path / "b.json") == tmp_path / "b.json"
    assert json.loads((tmp_path / "b.json").read_text())["versions"] == {"torch": "t"}


def test_settings_become_json():
    assert jsonable({1: (Path("a"), None, object)}) == {"1": ["a", None, str(object)]}
