"""Training: convergence, eager vs compiled agreement, and checkpoint round trips."""

from __future__ import annotations

import copy

import pytest
import torch

from tk.errors import IntegrityError, UsageError
from tk.models import build_model
from tk.models.checkpoint import load_state_dict, load_weights, read_sidecar, save_checkpoint
from tk.models.linear import SIZES as LINEAR_SIZES
from tk.models.linear import ground_truth
from tk.models.train import CompileOptions, train


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_linear_regression_finds_the_true_w_and_b(size):
    spec = build_model("linear", size=size)
    result = train(spec, seed=0)
    w, b = ground_truth(LINEAR_SIZES[size])
    assert result.final_loss < 1e-3
    assert result.steps < spec.task.steps, "the loop should stop early once the average loss is below 1e-3"
    assert (spec.module.weight.detach() - w).abs().max().item() < 1e-2
    assert (spec.module.bias.detach() - b).abs().max().item() < 1e-2


def test_transformer_learns_its_task():
    spec = build_model("transformer", size="tiny")
    result = train(spec, steps=200, seed=0)
    assert result.final_loss < 0.5 * result.first_loss
    assert result.val_accuracy is not None and result.val_accuracy > 0.85
    assert spec.module.training, "training returns the module to train mode after validation"


def test_mlp_learns_its_task():
    result = train(build_model("mlp", size="tiny"), seed=0)
    assert result.val_accuracy is not None and result.val_accuracy > 0.8


@pytest.mark.slow
def test_compiled_step_matches_eager_step():
    eager_spec = build_model("mlp", size="tiny")
    compiled_spec = build_model("mlp", size="tiny")
    compiled_spec.module.load_state_dict(eager_spec.module.state_dict())
    train(eager_spec, steps=1, seed=5, lr=1e-2)
    result = train(compiled_spec, steps=1, seed=5, lr=1e-2, compile_options=CompileOptions(fullgraph=True))
    assert result.compiled and result.graph_breaks == 0
    for (name, p_eager), p_compiled in zip(
        eager_spec.module.named_parameters(), compiled_spec.module.parameters(), strict=True
    ):
        torch.testing.assert_close(p_compiled, p_eager, rtol=1e-5, atol=1e-6, msg=f"parameter {name}")


@pytest.mark.slow
def test_compiled_checkpoint_loads_into_a_fresh_eager_model(tmp_path):
    spec = build_model("mlp", size="tiny")
    train(spec, steps=5, compile_options=CompileOptions())
    path = save_checkpoint(torch.compile(spec.module), tmp_path / "mlp.safetensors", {"name": "mlp"})
    keys = load_state_dict(path).keys()
    assert not any(k.startswith("_orig_mod.") for k in keys)
    fresh = build_model("mlp", size="tiny")
    load_weights(fresh.module, path)
    x = fresh.example_inputs()[0]
    with torch.no_grad():
        torch.testing.assert_close(fresh.module.eval()(x), spec.module.eval()(x), rtol=0, atol=0)
    assert read_sidecar(path)["sha256"]


def test_fullgraph_graph_break_is_one_clear_error():
    spec = build_model("mlp", size="tiny")
    inner = spec.module

    class Breaks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            print("side effect")
            return self.inner(x)

    spec.module = Breaks()
    from tk.errors import CaptureError

    with pytest.raises(CaptureError, match="graph break under --fullgraph"):
        train(spec, steps=1, compile_options=CompileOptions(fullgraph=True))


def test_a_pickle_with_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "evil.pt"
    torch.save({"weight": Evil()}, path)
    with pytest.raises(IntegrityError, match="refused"):
        load_state_dict(path)
    assert not marker.exists()


def test_a_weights_only_torch_file_loads(tmp_path):
    spec = build_model("linear", size="tiny")
    torch.save(spec.module.state_dict(), tmp_path / "w.pt")
    fresh = build_model("linear", size="tiny")
    load_weights(fresh.module, tmp_path / "w.pt")
    torch.testing.assert_close(fresh.module.weight, spec.module.weight, rtol=0, atol=0)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    path = save_checkpoint(build_model("mlp", size="tiny").module, tmp_path / "mlp.safetensors", {})
    with pytest.raises(UsageError, match="does not fit this model"):
        load_weights(build_model("linear", size="tiny").module, path)


def test_a_damaged_safetensors_file_is_refused(tmp_path):
    path = save_checkpoint(build_model("mlp", size="tiny").module, tmp_path / "mlp.safetensors", {})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(IntegrityError):
        load_weights(build_model("mlp", size="tiny").module, path)


def test_training_updates_the_weights_in_place():
    spec = build_model("linear", size="tiny")
    before = copy.deepcopy(spec.module.state_dict())
    train(spec, steps=3)
    assert not torch.equal(before["weight"], spec.module.weight.detach())
