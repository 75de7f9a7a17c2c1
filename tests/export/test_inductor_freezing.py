"""Each frozen compile packs float weights as its own ``cpp.weight_prepack`` says, in whatever order
compiles come in a process (Inductor alone decides it once a process: tk.formats.inductor_freezing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tk.export.aoti.writer import unavailable_reason as aoti_unavailable
from tk.formats.inductor_freezing import packing_registry_missing

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(aoti_unavailable("cpu") is not None, reason=str(aoti_unavailable("cpu"))),
    pytest.mark.skipif(packing_registry_missing() is not None, reason=str(packing_registry_missing())),
]

# A fresh process, so that its first frozen compile is the unpacked one (the order the suite cannot
# promise): unpacked, packed, unpacked packages, then torch.compile with freezing as the compile engine
# runs it (Dynamo reads freezing from the process-wide config); each one's outputs against the module's.
SCRIPT = """
import json, sys, zipfile
from pathlib import Path
import torch
from torch._dynamo.utils import counters
from tk.export.aoti.writer import aoti_package_from_exported_program
from tk.formats.inductor_freezing import inductor_freezing, register_float_weight_packing

torch.manual_seed(0)
module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).eval()
x = torch.randn(4, 64)
program = torch.export.export(module, (x,))
report = {"packages": []}
for i, packed in enumerate([False, True, False]):
    path = Path(sys.argv[1]) / f"{i}.pt2"
    configs = {"freezing": True} if packed else {"freezing": True, "cpp.weight_prepack": False}
    aoti_package_from_exported_program(program, path, inductor_configs=configs)
    with zipfile.ZipFile(path) as archive:
        source = "".join(archive.read(n).decode(errors="replace") for n in archive.namelist() if n.endswith(".cpp"))
    with torch.no_grad():
        error = (torch._inductor.aoti_load_package(str(path))(x) - module(x)).abs().max().item()
    report["packages"].append({"packed": packed, "calls": source.count("_linear_pointwise"), "error": error})
register_float_weight_packing()
before = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
with torch.no_grad(), inductor_freezing(), torch._inductor.config.patch(fx_graph_cache=False):
    error = (torch.compile(module)(x) - module(x)).abs().max().item()
report["compiled"] = {"packs": counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] - before, "error": error}
print(json.dumps(report))
"""


def test_each_frozen_compile_packs_as_its_config_says_in_any_order(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    calls = [(p["packed"], p["calls"] > 0) for p in report["packages"]]
    assert calls == [(False, False), (True, True), (False, False)], report  # oneDNN's packed linear iff asked
    assert all(p["error"] < 1e-5 for p in report["packages"]), report
    assert report["compiled"]["packs"] == 2 and report["compiled"]["error"] < 1e-5, report  # both linears
