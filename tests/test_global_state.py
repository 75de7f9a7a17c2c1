"""Library calls leave process-wide state as they found it: the umask, the root logger, the
warning filters, sys.path, torch's thread count, and Dynamo's caches of other compiled code."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import warnings

import pytest
import torch

from tk.errors import ConversionError
from tk.export import ExportOptions
from tk.export.onnx.writer import OnnxOptions
from tk.models import build_model
from tk.models.train import CompileOptions, train
from tk.runtime import load
from tk.spec import random_feeds
from tk.workflows.export import export


def snapshot() -> dict:
    umask = os.umask(0o022)
    os.umask(umask)
    return {
        "umask": umask,
        "root_level": logging.getLogger().level,
        "root_handlers": list(logging.getLogger().handlers),
        "warning_filters": list(warnings.filters),
        "sys_path": list(sys.path),
        "threads": torch.get_num_threads(),
    }


@pytest.mark.slow
def test_export_train_and_load_leave_process_state_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(3, 2)\n")
    import onnxruntime.quantization  # noqa: F401  # libraries add their own filters at first import
    import onnxscript  # noqa: F401
    import sympy  # noqa: F401

    for name in ("requests", "urllib3"):  # where installed, the calls below import them (first alone: its filters)
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    import torch.onnx
    import torch.utils.cpp_extension

    before = snapshot()
    compiled = torch.compile(lambda x: x * 2 + 1)
    compiled(torch.ones(3))  # another compiled function in the process
    from torch._dynamo.utils import counters

    frames_before = counters["frames"]["ok"]
    export(
        build_model("mymodel:build", input_descriptions=("x:float32:2x3",)),
        tmp_path / "user",
        ExportOptions(formats=("torch",)),
    )
    out = tmp_path / "art"
    with pytest.raises(ConversionError, match="no layer stayed int8"):  # random weights: static int8 keeps none
        export(
            build_model("linear", size="tiny"), tmp_path / "static", ExportOptions(formats=("onnx",), precision="int8")
        )
    dynamic = {"onnx": OnnxOptions(int8_mode="dynamic")}
    export(
        build_model("linear", size="tiny"), out, ExportOptions(formats=("onnx",), precision="int8", settings=dynamic)
    )
    result = train(build_model("linear", size="tiny"), steps=3, compile_options=CompileOptions())
    assert result.compiled and result.graphs >= 1
    with load(out, "onnx", threads=1) as engine:
        engine.run(random_feeds(engine.inputs, {"batch": 2}))
    after = snapshot()
    for key in before:
        assert after[key] == before[key], (key, before[key], after[key])
    assert counters["frames"]["ok"] >= frames_before, "Dynamo's counters were not reset"
    compiled(torch.ones(3))  # still served from its cache: no new frame compiled
    assert os.stat(out / "manifest.json").st_mode & 0o777 == 0o666 & ~before["umask"]
