"""Typed engine options: declared per engine, unknown names refused with the valid list, reported
by settings(); the thread count is an explicit option scoped to the engine's calls."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tk.errors import UsageError
from tk.registries import ENGINES
from tk.runtime import engine_class, engine_options, load
from tk.runtime.eager import CompileOptions
from tk.runtime.onnxrt import OnnxOptions
from tk.spec import random_feeds

ONNX = ("onnx",)


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_engine_declares_frozen_options(name):
    options = engine_class(name).Options
    assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen
    assert "threads" in {f.name for f in dataclasses.fields(options)}


def test_a_misspelled_option_is_refused_with_the_valid_ones(exported):
    e = exported("linear", ONNX)
    with pytest.raises(
        UsageError, match=r"engine 'onnx': unknown option\(s\) optimisation; it takes threads, provider"
    ):
        load(e.root, "onnx", optimisation="basic")
    with pytest.raises(
        UsageError, match=r"unknown option\(s\) provider; it takes threads, cuda_graph, max_graphs, trust_model_code"
    ):
        load(e.root, "eager", options={"provider": "cpu"})


def test_engine_options_keeps_what_each_engine_declares():
    values = {"provider": "cpu", "threads": 2, "mode": "default", "cuda_graph": None, "trust_model_code": True}
    assert engine_options("onnx", values) == {"provider": "cpu", "threads": 2}
    assert engine_options("compile", values) == {"threads": 2, "mode": "default", "trust_model_code": True}
    assert engine_options("torch", values) == {"threads": 2}


def test_options_arrive_typed_and_settings_report_them(exported):
    e = exported("linear", ONNX)
    with load(e.root, "onnx", options=OnnxOptions(threads=1, optimization="basic")) as engine:
        assert engine.options == OnnxOptions(threads=1, optimization="basic")
        settings = engine.settings()
        assert settings["threads"] == 1 and settings["intra_op_threads"] == 1
        assert settings["optimization"] == "basic" and settings["graph_optimization_level"] == "ORT_ENABLE_BASIC"
    with pytest.raises(UsageError, match="expected CompileOptions, got OnnxOptions"):
        load(e.root, "compile", options=OnnxOptions())
    assert CompileOptions().freezing and CompileOptions().dynamic


def test_torch_threads_apply_to_the_call_and_are_restored(exported):
    e = exported("linear", ("torch",))
    before = torch.get_num_threads()
    seen = []
    with load(e.root, "torch", threads=1) as engine:
        engine.load()
        inner = engine.module.forward

        def spy(*args):
            seen.append(torch.get_num_threads())
            return inner(*args)

        engine.module.forward = spy
        feeds = random_feeds(engine.inputs, {"batch": 2})
        out = engine.run(feeds)
    assert seen == [1] and torch.get_num_threads() == before
    assert np.isfinite(out["y"]).all()
