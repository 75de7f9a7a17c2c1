"""The example CI job (examples/ci/): its shell script's steps run on a tiny model, its YAML calls them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "ci" / "gate.sh"


def gate(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    settings = {
        "MODEL": "mlp",
        "SIZE": "tiny",
        "FORMAT": "torch",
        "BASELINES": str(tmp_path / "baselines"),
        "OUT": str(tmp_path / "out"),
        "BATCH_SIZES": "1,2",
        "ITERS": "10",
        # the steps are tested here, not this machine's speed: a tiny MLP's sub-millisecond calls moved 17x
        # between two runs once (a speed-up of 8.57 recorded, 0.49 judged)
        "MAX_SLOWDOWN": "99",
        "TK": f"{sys.executable} -m tk",
        **env,
    }
    environ = {**os.environ, **settings, "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", str(SCRIPT)], env=environ, capture_output=True, text=True, timeout=600)


def failures(path: Path) -> dict[str, str]:
    return {
        f"{c.get('classname')} {c.get('name')}": c.find("failure").get("message")
        for c in ET.parse(path).getroot().iter("testcase")
        if c.find("failure") is not None
    }


@pytest.mark.slow
@pytest.mark.fits(seconds=120)
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_gate_records_passes_and_catches_bf16(tmp_path: Path) -> None:
    missing = gate(tmp_path)
    assert missing.returncode == 2 and "RECORD=1" in missing.stderr

    record = gate(tmp_path, RECORD="1")
    assert record.returncode == 0, record.stderr[-2000:]
    accuracy = json.loads((tmp_path / "baselines" / "accuracy.json").read_text())
    speed = json.loads((tmp_path / "baselines" / "speed.json").read_text())
    assert set(accuracy["engines"]) == {"torch"} and set(speed["engines"]["torch"]) == {"1", "2"}

    first = tmp_path / "first-artifact"
    shutil.copytree(tmp_path / "out" / "artifact", first)
    again = gate(tmp_path, ARTIFACT=str(first))  # the same fp32 artifact, a second time
    assert again.returncode == 0, again.stderr[-2000:]
    check_xml, bench_xml = tmp_path / "out" / "check.xml", tmp_path / "out" / "bench.xml"
    assert not failures(check_xml) and not failures(bench_xml)
    assert len(list(ET.parse(bench_xml).getroot().iter("testcase"))) == 2

    bf16 = gate(tmp_path, PRECISION="bf16")
    assert bf16.returncode == 1, bf16.stderr[-2000:]
    failed = failures(check_xml)
    assert "tk.check.torch logits sqnr_db" in failed and "logits" in failed["tk.check.torch logits sqnr_db"]
    assert bench_xml.is_file()  # the bench step ran after the failed check


def test_the_github_job_runs_the_script_and_uploads_junit() -> None:
    job = yaml.safe_load((ROOT / "examples" / "ci" / "github-actions.yml").read_text())["jobs"]["gate"]
    steps = {step.get("name"): step for step in job["steps"]}
    assert steps["Export, check and bench against the baselines"]["run"] == "bash examples/ci/gate.sh"
    upload = steps["Upload the JUnit files"]
    assert upload["if"] == "always()" and upload["with"]["path"] == "ci-out/*.xml"
    assert steps["Export, check and bench against the baselines"]["env"]["OUT"] == "ci-out"
