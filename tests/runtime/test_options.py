"""Typed engine options: declared per engine, unknown names refused with the valid list, reported
by settings(); the thread count is an explicit option scoped to the engine's calls."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tk.errors import UsageError
from tk.registries import ENGINES
from tk.runtime import EngineChoice, engine_class, load, open_engine
from tk.runtime.eager import CompileOptions
from tk.runtime.onnxrt import OnnxSessionOptions
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


def test_an_engine_says_which_options_it_declares():
    assert engine_class("onnx").option_names() == {"threads", "provider", "optimization", "spinning"}
    assert {"mode", "trust_model_code", "cuda_graph"} <= engine_class("compile").option_names()
    assert "provider" not in engine_class("aoti").option_names()


def test_a_choice_gives_each_engine_what_it_declares_among_those_opened():
    values = {"provider": "cpu", "threads": 2, "mode": "default", "cuda_graph": None, "trust_model_code": True}
    choice = EngineChoice("all", options=values)
    assert choice.options == {"provider": "cpu", "threads": 2, "mode": "default", "trust_model_code": True}
    among = ["onnx", "compile", "torch"]
    assert choice.options_for("onnx", among) == {"provider": "cpu", "threads": 2}
    assert choice.options_for("compile", among) == {"threads": 2, "mode": "default", "trust_model_code": True}
    assert choice.options_for("torch", among) == {"threads": 2}


@pytest.mark.parametrize(
    ("engine", "options", "message"),
    [
        ("aoti", {"provider": "cpu"}, "--provider applies to the onnx engine, not aoti"),
        ("onnx", {"mode": "max-autotune"}, "--mode applies to the compile engine, not onnx"),
        ("torch", {"trust_model_code": True}, "--trust-model-code applies to the eager and compile engines, not torch"),
        (
            "onnx",
            {"cuda_graph": True},
            "--cuda-graph applies to the eager, compile, torch, aoti and trt engines, not onnx",
        ),
    ],
)
def test_an_option_the_chosen_engine_does_not_declare_is_refused(engine, options, message):
    with pytest.raises(UsageError, match=f"^{message}$"):
        EngineChoice(engine, options=options).options_for(engine)


def test_an_option_is_refused_only_when_no_engine_opened_together_declares_it():
    choice = EngineChoice("all", options={"provider": "cpu"})
    assert choice.options_for("torch", ["torch", "onnx"]) == {}  # onnx takes it
    with pytest.raises(UsageError, match=r"^--provider applies to the onnx engine, not torch, aoti$"):
        choice.options_for("torch", ["torch", "aoti"])


def test_defaults_of_a_caller_go_only_where_declared_and_never_over_the_users():
    choice = EngineChoice("onnx", options={"threads": 2})
    assert choice.with_defaults({"spinning": False}, ["onnx"]).options == {"spinning": False, "threads": 2}
    assert choice.with_defaults({"spinning": False}, ["torch"]) is choice
    assert choice.with_defaults({"threads": 1}, ["onnx"]).options == {"threads": 2}


def test_open_engine_refuses_before_loading_and_opens_with_the_declared_options(exported):
    e = exported("linear", ONNX)
    with pytest.raises(UsageError, match=r"^--mode applies to the compile engine, not onnx$"):
        open_engine(e.root, EngineChoice("onnx", options={"mode": "max-autotune"}))
    engine = open_engine(e.root, EngineChoice("onnx", options={"threads": 1, "provider": "cpu"}))
    assert engine.options == OnnxSessionOptions(threads=1, provider="cpu")
    with pytest.raises(UsageError, match=r"engine 'onnx': unknown option\(s\) optimisation"):
        open_engine(e.root, EngineChoice("onnx", options={"optimisation": "basic"}))  # no engine declares it


def test_options_arrive_typed_and_settings_report_them(exported):
    e = exported("linear", ONNX)
    with load(e.root, "onnx", options=OnnxSessionOptions(threads=1, optimization="basic")) as engine:
        assert engine.options == OnnxSessionOptions(threads=1, optimization="basic")
        settings = engine.settings()
        assert settings["threads"] == 1 and settings["intra_op_threads"] == 1
        assert settings["optimization"] == "basic" and settings["graph_optimization_level"] == "ORT_ENABLE_BASIC"
    with pytest.raises(UsageError, match="expected CompileOptions, got OnnxSessionOptions"):
        load(e.root, "compile", options=OnnxSessionOptions())
    assert not CompileOptions().freezing and CompileOptions().dynamic  # torch.compile's own defaults


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch: Inductor packs nothing")
@pytest.mark.parametrize("freezing", [False, True])
def test_compile_freezes_the_weights_only_when_asked(exported, freezing):
    # torch.compile's options={"freezing": True} alone never froze (Dynamo reads the process-wide config); frozen on
    # the CPU, Inductor hands each of the MLP's three linears to oneDNN's packed linear (its counter, cache off)
    from torch._dynamo.utils import counters

    e = exported("mlp", ("torch",))
    before, packed = torch._inductor.config.freezing, counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
    with load(e.root, "compile", options=CompileOptions(freezing=freezing)) as engine:
        feeds = random_feeds(engine.inputs, {"batch": 3}, seed=5)
        with torch._inductor.config.patch(fx_graph_cache=False):
            out = engine.run(feeds)
        assert torch._inductor.config.freezing is before  # set for the call only
        assert engine.settings()["freezing"] is freezing
    packs = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] - packed
    assert packs == (3 if freezing else 0), packs
    with load(e.root, "eager") as eager:
        reference = eager.run(feeds)
    assert all(np.abs(out[n] - reference[n]).max() < 1e-5 for n in reference)


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
