"""``tk.export.aoti.constant_names``: a repeated original name becomes the constant's own, without a compile
(the int8 package test checks a real package's names and that the engine then moves every constant)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from torch._inductor.graph import GraphLowering

from tests.conftest import run_each_in_thread
from tk.export.aoti.constant_names import _renaming, unique_constant_names


def _allocate(graph, name, data):
    """What Inductor's allocator does with names (torch 2.14): the first takes the name, repeats get ``_N``."""
    own, n = name, 0
    while own in graph.constants:
        own, n = f"{name}_{n}", n + 1
    graph.constants[own] = data
    graph.allocated_constant_name[own] = name
    return own


def _graph(meta=None):
    return SimpleNamespace(constants={}, allocated_constant_name={}, module=SimpleNamespace(meta=meta or {}))


def test_repeats_carry_their_own_names_and_the_first_keeps_the_original():
    allocate = _renaming(_allocate)
    graph = _graph({"_zero_point_0__original__": torch.zeros(4)})
    for name in ("blocks.0.weight", "x_scale", "x_scale", "_zero_point_0", "_zero_point_0", "x_scale"):
        allocate(graph, name, torch.ones(1))
    assert graph.allocated_constant_name == {
        "blocks.0.weight": "blocks.0.weight",
        "x_scale": "x_scale",
        "x_scale_0": "x_scale_0",
        "_zero_point_0": "_zero_point_0",
        "_zero_point_0_0": "_zero_point_0_0",
        "x_scale_1": "x_scale_1",
    }
    # the value AOTInductor writes for the copy is still the one it read before tracing, under its new name
    assert graph.module.meta["_zero_point_0_0__original__"] is graph.module.meta["_zero_point_0__original__"]
    assert "x_scale_0__original__" not in graph.module.meta


def test_the_wrapper_is_inductors_own_outside_and_shared_by_overlapping_holders():
    original = GraphLowering.allocate_non_dup_const_name
    with unique_constant_names():
        wrapped = GraphLowering.allocate_non_dup_const_name
        assert wrapped is not original and wrapped.__wrapped__ is original
        with unique_constant_names():
            assert GraphLowering.allocate_non_dup_const_name is wrapped
        assert GraphLowering.allocate_non_dup_const_name is wrapped  # the outer holder still holds it
    assert GraphLowering.allocate_non_dup_const_name is original
    with pytest.raises(RuntimeError), unique_constant_names():
        raise RuntimeError("a failed compile")
    assert GraphLowering.allocate_non_dup_const_name is original


def test_holders_in_threads_leave_inductors_own_allocator():
    original = GraphLowering.allocate_non_dup_const_name
    barrier = threading.Barrier(4)

    def hold(_: int) -> None:
        with unique_constant_names():
            barrier.wait(timeout=30)
            assert GraphLowering.allocate_non_dup_const_name is not original

    assert run_each_in_thread(hold, 4, timeout=60) == []
    assert GraphLowering.allocate_non_dup_const_name is original
