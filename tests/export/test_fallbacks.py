"""When one converter fails, the next (issue #49, item 4): ONNX decomposed with its views as reshapes
where torch.onnx fails on the program as captured (T5's encoder), OpenVINO from tk's ONNX where its
PyTorch frontend fails (GPT-2 with its cache on), and a failure that no fallback fixes costs only its
own format: the artifact keeps the others, names the failure, and the command exits non-zero."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from tk.cli import cli
from tk.export import ExportOptions
from tk.export.onnx.writer import failure_site
from tk.manifest import read_manifest
from tk.models import build_model
from tk.models.base import ModelSpec
from tk.models.user import UserModel
from tk.workflows.export import export

transformers = pytest.importorskip("transformers")


def _user_spec(module: torch.nn.Module, name: str) -> ModelSpec:
    """A transformers model as a user model taking input_ids of (batch, seq), its last_hidden_state out."""
    import sys
    import types

    holder = types.ModuleType(f"tk_fallback_{name}")
    made = UserModel(module, {"input_ids": torch.randint(0, 100, (2, 16))},
                     dynamic_dims={"input_ids": {0: "batch", 1: "seq"}}, output_names=["last_hidden_state"])  # fmt: skip
    holder.build = lambda: made
    sys.modules[holder.__name__] = holder
    return build_model(f"{holder.__name__}:build")


@pytest.mark.slow
def test_t5_encoder_onnx_converts_through_the_fallback(tmp_path):
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    spec = _user_spec(transformers.T5EncoderModel(config).eval(), "t5")
    result = export(spec, tmp_path / "t5", ExportOptions(formats=("torch", "onnx")))
    assert result.passed
    fallback = result.manifest.formats["onnx"]["fallback"]
    assert fallback.startswith("decomposed to core ATen first, views written as reshapes"), fallback
    assert "aten.view" in fallback and "Cannot view a tensor" in fallback, fallback
    assert result.manifest.check["onnx"]["passed"]
    shown = CliRunner().invoke(cli, ["inspect", str(tmp_path / "t5")])
    assert "fallback   onnx: decomposed to core ATen first" in shown.stdout, shown.stdout


@pytest.mark.slow
def test_gpt2_openvino_converts_from_tks_onnx(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    spec = _user_spec(transformers.GPT2Model(config).eval(), "gpt2")  # use_cache on: the cache's cat stays
    result = export(spec, tmp_path / "g", ExportOptions(formats=("torch", "openvino")))
    assert result.passed
    fallback = result.manifest.formats["openvino"]["fallback"]
    assert fallback.startswith("converted from tk's ONNX of the program (the PyTorch frontend failed"), fallback
    assert "Check 'false' failed" not in fallback, "OpenVINO's cause is kept, not its C++ header"


def test_a_failure_no_fallback_fixes_keeps_the_other_formats(tmp_path):
    """tests/planted.py's linalg_eigh has no ONNX translation and no OpenVINO conversion: torch is written
    and checked, onnx and openvino are named as failed in the manifest, and the command exits 2."""
    out = tmp_path / "art"
    result = CliRunner().invoke(cli, ["export", "tests.planted:no_converter", "--format", "torch", "--format", "onnx",
                                      "--format", "openvino", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "onnx failed" in errors[0] and "holds torch (passed)" in errors[0], result.stderr
    assert "openvino failed" in errors[0] and "linalg_eigh" in errors[0], errors[0]
    manifest = read_manifest(out)
    assert set(manifest.formats) == {"torch"} and set(manifest.failed) == {"onnx", "openvino"}
    assert manifest.check["torch"]["passed"] and manifest.status == "passed"
    assert {e.role for e in manifest.files} == {"weights", "torch"}
    shown = CliRunner().invoke(cli, ["inspect", str(out)])
    assert "failed     onnx: " in shown.stdout, shown.stdout
    checked = CliRunner().invoke(cli, ["check", str(out)])
    assert checked.exit_code == 0, checked.output


def test_one_format_alone_that_fails_is_the_error_as_before(tmp_path):
    result = CliRunner().invoke(
        cli, ["export", "tests.planted:no_onnx", "--format", "onnx", "--out", str(tmp_path / "a")]
    )
    assert result.exit_code == 2 and not (tmp_path / "a").exists(), result.output
    assert "torch.onnx could not convert the exported program" in result.stderr, result.stderr


def test_failure_site_names_the_operator_and_the_cause():
    inner = ValueError("Cannot view a tensor with shape (2, 3) as (6,)!\n\nWhile executing %view_4 : [num_users=1] = "
                       "call_function[target=torch.ops.aten.view.default](args = (%t,))")  # fmt: skip
    try:
        try:
            raise inner
        except ValueError as exc:
            raise RuntimeError("Failed to decompose the FX graph for ONNX compatibility.") from exc
    except RuntimeError as outer:
        site = failure_site(outer)
    assert site.startswith("torch.ops.aten.view.default: ValueError: Cannot view a tensor"), site
    assert json.dumps(site)  # one plain line


def test_optimize_keeps_the_formats_of_a_group_that_converted_and_caches_them(tmp_path):
    """A shared fp32 group where onnx cannot convert: torch is judged from the same export, onnx is a failed
    row with the conversion's reason, and a second run reuses the cached artifact (review: every run exported
    the group again, then each format alone)."""
    from tk.models import build_model
    from tk.workflows.optimize import OptimizeOptions, optimize

    def run() -> dict:
        options = OptimizeOptions(formats=("torch", "onnx"), precisions=("fp32",), seconds=0.1,
                                  cache_dir=tmp_path / "cache")  # fmt: skip
        result = optimize(build_model("tests.planted:no_converter"), tmp_path / "out", options)
        return {"rows": {r.candidate: r for r in result.rows}, "exports": result.exports, "hits": result.cache_hits,
                "winner": result.winner}  # fmt: skip

    first = run()
    assert first["winner"] is not None and first["winner"].candidate == "torch fp32"
    onnx = next(r for name, r in first["rows"].items() if name.startswith("onnx fp32"))
    assert onnx.status == "failed" and "no ONNX function" in onnx.reason, (onnx.status, onnx.reason)
    second = run()
    # the shared group and onnx's unfused one, each once: no second try of the shared group one format at a time;
    # the second run reuses the shared group (onnx's own group wrote nothing to reuse: it is tried again)
    assert first["exports"] == 2
    assert second["exports"] == 1 and second["hits"] == 1
