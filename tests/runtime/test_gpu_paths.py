"""The GPU paths' logic, exercised where it can run: CUDA-graph bookkeeping, TF32 scoping,
device-resident I/O; what needs a GPU is marked ``gpu`` and skips with the missing requirement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import requires
from tk.errors import UsageError
from tk.formats.tf32 import matmul_precision
from tk.runtime import load
from tk.runtime.cuda import GraphCache, ShapeCache, signature_of
from tk.spec import random_feeds


def test_shape_cache_makes_each_key_once_within_capacity():
    made = []
    cache: ShapeCache[str] = ShapeCache(capacity=2)
    for key in ["a", "b", "a", "c", "b", "c"]:
        cache.get_or_make(key, lambda k=key: made.append(k) or f"entry-{k}")
    assert made == ["a", "b"], "a key past capacity gets no entry"
    assert cache.stats == {"hits": 2, "made": 2, "over_capacity": 2, "refused": 0}
    cache.refuse("a", "its first replay differed")
    assert cache.get_or_make("a", lambda: "again") is None and "a" not in cache.entries
    assert cache.stats["refused"] == 1 and cache.refused == {"a": "its first replay differed"}


def test_a_changed_shape_or_dtype_is_another_key():
    a = (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64))
    assert signature_of(a) == signature_of(tuple(t.clone() for t in a))
    assert signature_of(a) != signature_of((torch.zeros(3, 3), a[1]))
    assert signature_of(a) != signature_of((a[0], a[1].int()))


def test_tf32_is_scoped_to_the_block():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with matmul_precision(True):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        with matmul_precision(False):
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.mark.parametrize("engine_name", ["eager", "torch"])
def test_fp32_engines_run_without_tf32_and_restore_the_flags(exported, engine_name):
    e = exported("mlp", ("torch",))
    torch.backends.cudnn.allow_tf32 = True  # torch's default: on
    seen = []
    with load(e.root, engine_name) as engine:
        engine.load()
        inner = engine._forward
        engine._forward = lambda *args: seen.append(torch.backends.cudnn.allow_tf32) or inner(*args)
        engine.run(random_feeds(engine.inputs, {"batch": 2}))
    assert seen == [False] and torch.backends.cudnn.allow_tf32 is True


def test_torch_in_gives_torch_out_on_the_engine_device(exported):
    e = exported("mlp", ("torch",))
    with load(e.root, "torch") as engine:
        feeds = {k: torch.from_numpy(v) for k, v in random_feeds(engine.inputs, {"batch": 3}).items()}
        checked = engine.run(feeds)
        fast = engine.run(feeds, check=False)  # the caller checked this shape already
    for name, value in checked.items():
        assert isinstance(value, torch.Tensor) and value.device.type == "cpu"
        np.testing.assert_array_equal(value.numpy(), fast[name].numpy())


@pytest.mark.parametrize("engine_name", ["eager", "torch"])
def test_cuda_graphs_on_the_cpu_are_one_clear_error(exported, engine_name):
    e = exported("mlp", ("torch",))
    with pytest.raises(UsageError, match="CUDA graphs need --device cuda"):
        load(e.root, engine_name, cuda_graph=True).load()


@pytest.mark.gpu
@requires(cuda=True)
def test_graph_replays_equal_normal_calls_and_never_replay_a_stale_shape():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).cuda().eval()
    graphs = GraphCache(model, max_graphs=2)
    with torch.inference_mode():
        for batch in (1, 8, 1, 8, 3):
            x = torch.randn(batch, 16, device="cuda")
            (out,) = graphs(x)
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
            assert out.shape == (batch, 4)
    assert graphs.stats()["graphs"] == 2 and graphs.stats()["over_capacity"] == 1


@pytest.mark.gpu
@requires(cuda=True)
@pytest.mark.parametrize("engine_name", ["eager", "torch", "aoti"])
def test_cuda_graph_engines_match_plain_calls(tmp_path, engine_name):
    from tk.export import ExportOptions
    from tk.models import build_model
    from tk.workflows.export import export

    fmt = {"eager": "torch", "torch": "torch", "aoti": "aoti"}[engine_name]
    root = export(
        build_model("transformer", size="tiny"), tmp_path / "a", ExportOptions(formats=(fmt,), device="cuda")
    ).out
    with (
        load(root, engine_name, device="cuda") as plain,
        load(root, engine_name, device="cuda", cuda_graph=True) as graphed,
    ):
        for sizes in ({"batch": 1, "seq": 16}, {"batch": 4, "seq": 9}, {"batch": 1, "seq": 16}):
            feeds = {k: torch.from_numpy(v).cuda() for k, v in random_feeds(plain.inputs, sizes).items()}
            torch.testing.assert_close(graphed.run(feeds)["logits"], plain.run(feeds)["logits"], rtol=1e-5, atol=1e-5)
        assert graphed.settings()["cuda_graphs"]["graphs"] == 2


@pytest.mark.slow
def test_compile_reports_its_mode_graphs_and_recompilations(exported):
    e = exported("mlp", ("torch",))
    with load(e.root, "compile", mode="default") as engine:
        for batch in (2, 5, 7):
            engine.run(random_feeds(engine.inputs, {"batch": batch}))
        settings = engine.settings()
    assert settings["mode"] == "default" and settings["freezing"] is False
    assert settings["cuda_graphs"] == "not asked for"  # and on the CPU never used
    # Dynamo's counters are process-wide and its cache outlives the engine: in a long test session the
    # frames may already be compiled (or past Dynamo's recompile limit), so the numbers are read, not fixed
    assert settings["frames_compiled"] >= 0
    assert settings["recompilations"] == max(0, settings["frames_compiled"] - 1)
