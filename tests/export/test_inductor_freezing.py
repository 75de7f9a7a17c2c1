"""Each frozen compile packs float weights as its own ``cpp.weight_prepack`` says, in whatever order
compiles come in a process (Inductor alone decides it once a process: tk.formats.inductor_freezing)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tk.export.aoti.writer import unavailable_reason as aoti_unavailable
from tk.formats.inductor_freezing import packing_registry_missing

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(packing_registry_missing() is not None, reason=str(packing_registry_missing()))

# A fresh process, so that its first frozen compile is the unpacked one (the order the suite cannot
# promise; the other order is the suite's own: test_aoti's packed packages before test_aoti_int8's
# unpacked one): unpacked then packed packages, then torch.compile with freezing as the compile engine
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
for i, packed in enumerate([False, True]):
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


def _registry() -> list[list[object]]:
    from torch._inductor.fx_passes import freezing_patterns

    return [list(entries) for matcher in freezing_patterns.pass_patterns for entries in matcher.patterns.values()]


def _flat(lists: list[list[object]]) -> list[object]:
    return list(itertools.chain.from_iterable(lists))


def _packing_entries(lists: list[list[object]]) -> int:
    from tk.formats.inductor_freezing import _handler, _packing_handlers

    return sum(_handler(entry) in _packing_handlers() for entries in lists for entry in entries)


def test_the_packing_is_set_aside_for_a_compile_that_asks_for_none_and_put_back_once(monkeypatch):
    import torch
    from torch._inductor.fx_passes import freezing_patterns

    from tk.formats import inductor_freezing
    from tk.formats.inductor_freezing import float_weight_packing

    monkeypatch.setattr(inductor_freezing, "_handlers", frozenset())  # found afresh, as at a process's first use,
    with monkeypatch.context() as switched:  # even where oneDNN was switched off at the time
        switched.setattr(torch.backends.mkldnn, "enabled", False)
        with float_weight_packing(True):
            pass
    with float_weight_packing(True), float_weight_packing(True):
        packed = _registry()
    assert _packing_entries(packed) >= 2  # oneDNN's float linear and convolution packing at least
    with float_weight_packing(True):
        assert _registry() == packed  # registered once, never twice
    added = object()
    with pytest.raises(RuntimeError, match="inside"), float_weight_packing(False):
        assert _packing_entries(_registry()) == 0
        assert len(_flat(_registry())) == len(_flat(packed)) - _packing_entries(packed)  # only those
        first = next(iter(freezing_patterns.pass_patterns[0].patterns.values()))
        first.append(added)  # a pattern registered meanwhile (torchao's int8 ones, at its first quantization)
        raise RuntimeError("inside")
    after = _registry()
    first.remove(added)
    assert _flat(after).count(added) == 1 and [[e for e in es if e is not added] for es in after] == packed


def test_finding_the_packing_handlers_leaves_the_registry_a_compile_sees_as_it_is(monkeypatch):
    """The handlers are found by registering them into passes of tk's own: a compile in another thread at
    that moment (the registry read from inside the registration) sees every pattern the process registered."""
    from tk.formats import inductor_freezing
    from tk.formats.inductor_freezing import _packing_handlers, register_float_weight_packing

    register_float_weight_packing()  # the process's own registration first, as every caller has it
    before = _registry()
    seen_meanwhile = []
    register = inductor_freezing._register_packing

    def registering(module):
        register(module)
        seen_meanwhile.append(_registry())

    monkeypatch.setattr(inductor_freezing, "_handlers", frozenset())
    monkeypatch.setattr(inductor_freezing, "_register_packing", registering)
    handlers = _packing_handlers()
    assert len(handlers) >= 2 and seen_meanwhile == [before] and _registry() == before
    assert _packing_entries(before) >= 2  # the live registry's packing entries are the ones found


@pytest.mark.slow
@pytest.mark.skipif(aoti_unavailable("cpu") is not None, reason=str(aoti_unavailable("cpu")))
def test_each_frozen_compile_packs_as_its_config_says_in_any_order(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    calls = [(p["packed"], p["calls"] > 0) for p in report["packages"]]
    assert calls == [(False, False), (True, True)], report  # oneDNN's packed linear iff asked
    assert all(p["error"] < 1e-5 for p in report["packages"]), report
    assert report["compiled"]["packs"] == 2 and report["compiled"]["error"] < 1e-5, report  # both linears
