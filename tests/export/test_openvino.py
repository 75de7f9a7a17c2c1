"""The openvino format (an IR converted from the exported program) and the openvino engine.

fp32 must be float32 where OpenVINO runs it (its CPU default on AVX512-BF16/AMX is bf16); int8
comes from NNCF on a briefly trained tiny Transformer (random weights lose every layer to the
floor), judged at the int8 SQNR floor like the other int8 writers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tests.conftest import requires
from tk.errors import BackendUnavailableError, IntegrityError, UsageError
from tk.export import ExportOptions, format_unavailable_reason
from tk.export.openvino.int8 import SHAPE_OPS
from tk.formats.aoti import NATIVE_FLAGS, cpu_flags
from tk.formats.openvino import BIN, XML
from tk.manifest import read_manifest
from tk.models import build_model
from tk.runtime import available_engines, load
from tk.spec import random_feeds
from tk.tolerances import MIN_SQNR_DB, TOLERANCES
from tk.workflows.export import export

pytestmark = requires(openvino=True)
OV = ("openvino",)
HAS_BF16 = any(f in cpu_flags() for f in NATIVE_FLAGS["bf16"])


@pytest.mark.parametrize("name", ["transformer", "mlp"])
def test_fp32_ir_passes_the_export_check_at_min_opt_and_max(exported, name):
    e = exported(name, OV)
    manifest = e.manifest
    assert manifest.status == "passed" and manifest.precision == "fp32"
    roles = {f.role: f.path for f in manifest.files}
    assert roles["openvino"] == XML and roles["openvino-weights"] == BIN
    info = manifest.formats["openvino"]
    assert info["inference_precision_hint"] == "f32" and info["compress_to_fp16"] is False
    assert manifest.versions["openvino"].startswith("20")
    report = manifest.check["openvino"]
    dims, shapes = manifest.signature.dims, report["shapes"]
    assert {n: d.min for n, d in dims.items()} in shapes and {n: d.opt for n, d in dims.items()} in shapes
    for name, dim in dims.items():  # each dimension at its max
        assert any(s[name] == dim.max for s in shapes), (name, shapes)
    rtol, atol = TOLERANCES["fp32"]
    for output in report["outputs"]:
        assert output["passed"] and output["max_abs"] <= atol + rtol, output
    xml = (e.root / XML).read_text()
    assert 'element_type="f16"' not in xml  # weights kept float32 on disk (compress_to_fp16=False)


def test_engine_compiles_fp32_as_f32_and_reports_its_options(exported):
    e = exported("transformer", OV)
    with load(e.root, "openvino", threads=1, performance_hint="THROUGHPUT") as engine:
        settings = engine.settings()
        assert settings["inference_precision"] == "f32"  # not the CPU plugin's bf16 default on AMX
        assert settings["inference_num_threads"] == 1 and settings["threads"] == 1
        assert settings["performance_hint"] == "THROUGHPUT"
        feeds = random_feeds(engine.inputs, {"batch": 3, "seq": 64}, seed=4)
        out = engine.run(feeds)
        assert list(out) == ["logits"] and isinstance(out["logits"], np.ndarray) and out["logits"].shape == (3, 2)
        with torch.no_grad():
            ref = e.spec.module(*(torch.from_numpy(feeds[s.name]) for s in engine.inputs))
        np.testing.assert_allclose(out["logits"], ref.numpy(), rtol=1e-4, atol=1e-5)
        as_torch = engine.run({k: torch.from_numpy(v) for k, v in feeds.items()})
        assert isinstance(as_torch["logits"], torch.Tensor)
        np.testing.assert_array_equal(as_torch["logits"].numpy(), out["logits"])
    with pytest.raises(UsageError, match="performance_hint must be one of LATENCY, THROUGHPUT, got 'FAST'"):
        load(e.root, "openvino", performance_hint="FAST")
    with pytest.raises(UsageError, match=r"unknown option\(s\) provider; it takes threads, performance_hint"):
        load(e.root, "openvino", provider="cpu")


def test_streams_split_a_batch_into_requests_whose_outputs_join_in_order(exported, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    import openvino as ov

    def no_queue(*args: object) -> None:
        raise AssertionError("an AsyncInferQueue runs Python callbacks on OpenVINO's threads: 1 exit in 7 aborted")

    monkeypatch.setattr(ov, "AsyncInferQueue", no_queue)
    e = exported("transformer", OV)
    feeds = random_feeds(e.spec.signature.inputs, {"batch": 5, "seq": 32}, seed=7)
    with load(e.root, "openvino", threads=2) as one, load(e.root, "openvino", threads=2, streams=2) as two:
        assert two.settings()["num_streams"] == 2 and one.settings()["num_streams"] == 1
        want = one.run(feeds)["logits"]
        got = two.run(feeds)["logits"]
        assert got.shape == want.shape == (5, 2)
        # rows 0-2 and 3-4 ran as two requests: each row as one call computes it
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert "num_streams_few_rows" not in two.settings()
        # one row would run on one stream's share of the cores: it runs on a compile at OpenVINO's defaults
        single = two.run({k: v[3:4] for k, v in feeds.items()})["logits"]
        np.testing.assert_allclose(single, want[3:4], rtol=1e-5, atol=1e-6)
        assert two.settings()["num_streams_few_rows"] == 1
        with ThreadPoolExecutor(2) as pool:  # each calling thread its own requests
            results = list(pool.map(lambda _: two.run(feeds)["logits"], range(4)))
        for result in results:
            np.testing.assert_array_equal(result, got)
    with pytest.raises(UsageError, match="streams must be a positive integer, got 0"):
        load(e.root, "openvino", streams=0)


def test_infer_streams_flag_reaches_the_engine(exported, tmp_path):
    from tk.cli import cli

    e = exported("transformer", OV)
    outs = {}
    for name, flags in {"one": [], "two": ["--streams", "2"]}.items():
        outs[name] = tmp_path / f"{name}.npz"
        result = CliRunner().invoke(
            cli, ["infer", str(e.root), "--engine", "openvino", *flags, "--random", "5", "--out", str(outs[name])]
        )
        assert result.exit_code == 0, result.output
    with np.load(outs["one"]) as one, np.load(outs["two"]) as two:
        assert two["logits"].shape == (5, 2)
        np.testing.assert_allclose(two["logits"], one["logits"], rtol=1e-5, atol=1e-6)


def test_shapes_outside_the_dims_are_refused_before_openvino(exported):
    e = exported("mlp", OV)
    with load(e.root, "openvino") as engine:
        batch = engine.dims["batch"]
        feeds = random_feeds(engine.inputs, {"batch": batch.max + 1})
        with pytest.raises(Exception, match="batch"):
            engine.run(feeds)


def test_a_changed_weights_file_is_refused(exported, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(exported("mlp", OV).root, root)
    data = bytearray((root / BIN).read_bytes())
    data[-1] ^= 0xFF
    (root / BIN).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"model\.bin"):
        load(root, "openvino").load()


def test_engine_is_among_the_available_ones_and_cpu_only(exported):
    from tk.runtime.openvino import OpenVINOEngine

    assert "openvino" in available_engines(read_manifest(exported("mlp", OV).root))
    assert "CPU only" in OpenVINOEngine.unavailable_reason("cuda")


def test_tk_check_engine_all_runs_openvino(exported, tmp_path):
    from tk.cli import cli

    root = exported("mlp", OV).root
    report = tmp_path / "check.json"
    result = CliRunner().invoke(cli, ["check", str(root), "--engine", "all", "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert "openvino" in result.output
    data = json.loads(report.read_text())
    reports = data.get("reports", data)
    assert reports["openvino"]["passed"]


def test_precisions_and_options_it_cannot_honour_are_refused():
    from tk.export.openvino.writer import WRITER

    assert "export --device cpu" in WRITER.unavailable_reason("cuda", "fp32")  # also where a GPU is present
    assert WRITER.precisions == ("fp32", "bf16", "int8")
    fp16 = format_unavailable_reason("openvino", "cpu", "fp16")
    assert fp16 == "--precision fp16 is written for the torch, onnx, aoti and trt formats only"
    bf16 = format_unavailable_reason("openvino", "cpu", "bf16")
    if HAS_BF16:
        assert bf16 is None
    else:
        assert "compiles bf16 as f32 there" in bf16
    spec = build_model("mlp", size="tiny")
    with pytest.raises(BackendUnavailableError, match="--format openvino: --precision fp16"):
        export(spec, "/nonexistent/never", ExportOptions(formats=OV, precision="fp16"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--int8-mode", "dynamic"],
            "--int8-mode dynamic: openvino's int8 is one of static, weights, weights-int4; export the other formats",
        ),
        (
            ["--calibration-method", "minmax"],
            "--calibration-method: applies to --format onnx or aoti only; this export writes openvino",
        ),
    ],
)
def test_int8_flags_of_other_formats_are_refused_in_one_line(tmp_path, args, message):
    from tk.cli import cli

    out = tmp_path / "a"
    argv = ["export", "mlp", "--size", "tiny", "--format", "openvino", "--precision", "int8", "--out", str(out)]
    result = CliRunner().invoke(cli, [*argv, *args])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert not out.exists()


def test_keep_fp32_is_refused(tmp_path):
    spec = build_model("transformer", size="tiny")
    with pytest.raises(UsageError, match="--keep-fp32: the openvino format does not keep modules in float32 at"):
        export(spec, tmp_path / "a", ExportOptions(formats=OV, precision="int8", keep_fp32=("blocks.0.attn",)))


@pytest.mark.skipif(
    not HAS_BF16, reason="needs a CPU with avx512_bf16 or amx_bf16 (OpenVINO compiles bf16 as f32 elsewhere)"
)
def test_bf16_ir_runs_bf16_and_passes_its_check(tmp_path):
    torch.manual_seed(0)
    result = export(
        build_model("transformer", size="tiny"), tmp_path / "bf16", ExportOptions(formats=OV, precision="bf16")
    )
    assert result.passed and result.manifest.formats["openvino"]["inference_precision_hint"] == "bf16"
    assert 'element_type="bf16"' not in (tmp_path / "bf16" / XML).read_text()  # float32 IR, bf16 by the hint
    with load(tmp_path / "bf16", "openvino") as engine:
        assert engine.settings()["inference_precision"] == "bf16"


@pytest.fixture(scope="module")
def trained_int8(tmp_path_factory):
    from tk.models.train import train

    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    train(spec, steps=100, seed=0)
    out = tmp_path_factory.mktemp("ov-int8") / "int8"
    return spec, out, export(spec, out, ExportOptions(formats=OV, precision="int8"))


def _source(node: Any, through: tuple[str, ...] = (*SHAPE_OPS, "Gather")) -> Any:
    """The op a value comes from through ops that only move or convert it (the type name; a Constant's with
    its element type, as "Constant:i8")."""
    while node.get_type_name() in through and node.get_input_size():
        node = node.input_value(0).get_node()
    if node.get_type_name() == "Constant":
        return f"Constant:{node.get_element_type().get_type_name()}"
    return node.get_type_name()


def _int8_weight_products(xml: Path) -> list[Any]:
    """The MatMuls of an IR whose weight is an int8 constant (through its Convert and scale)."""
    import openvino as ov

    ops = ov.Core().read_model(xml).get_ordered_ops()
    weight = (*SHAPE_OPS, "Multiply", "Subtract")
    return [
        op
        for op in ops
        if op.get_type_name() == "MatMul"
        and _source(op.input_value(1).get_node(), weight) in ("Constant:i8", "Constant:u8")
    ]


@pytest.mark.slow
def test_int8_ir_by_nncf_passes_the_int8_floor(trained_int8):
    _, out, result = trained_int8
    assert result.passed
    quant = result.manifest.formats["openvino"]["quantization"]
    assert quant["quantizer"] == "nncf.quantize" and quant["mode"] == "static" and quant["model_type"] == "transformer"
    assert quant["quantizable_nodes"] >= 5
    assert quant["sqnr_db_export"] >= MIN_SQNR_DB["int8"]
    assert result.manifest.versions["nncf"]
    report = result.manifest.check["openvino"]
    assert report["min_sqnr_db"] == MIN_SQNR_DB["int8"]
    assert min(o["sqnr_db"] for o in report["outputs"] if o["sqnr_db"] is not None) >= MIN_SQNR_DB["int8"]
    quantized = quant["quantizable_nodes"] - len(quant["automatic_exclusions"])
    # some products are int8: each linear with an int8 weight reads its activation through a FakeQuantize (one
    # quantizer may feed several units, and an int8 embedding table has none: on the Zen 5 EPYC 13 for 14 units)
    assert quantized >= 1 and re.search(r'type="FakeQuantize"', (out / XML).read_text())
    int8_products = _int8_weight_products(out / XML)
    assert int8_products and all(_source(op.input_value(0).get_node()) == "FakeQuantize" for op in int8_products)
    # the products with int8 weights by weight shape (in, out), for the floor: the model's linears, fewer than
    # the units (which also count attention's products and int8 embedding tables)
    spec = trained_int8[0]
    linears = {(m.in_features, m.out_features) for m in spec.module.modules() if isinstance(m, torch.nn.Linear)}
    int8_weights = sum(count for _, _, count in quant["int8_linear_shapes"])
    assert 1 <= int8_weights <= quantized and {(k, n) for k, n, _ in quant["int8_linear_shapes"]} <= linears
    # what NNCF left float runs in bf16 on a CPU with bfloat16 products, where the IR still holds the judge's
    # target so (its SQNR recorded either way), else in float32
    from tk.export.int8.search import MARGIN_DB
    from tk.formats.aoti import runs_natively

    in_bf16 = quant["automatic_exclusions_run_in"] == "bf16"
    if runs_natively("bf16"):
        assert in_bf16 == (quant["sqnr_db_float_part_bf16"] >= MIN_SQNR_DB["int8"] + MARGIN_DB)
        assert in_bf16 or quant["float_part"].startswith("float32: with it in bf16")
    else:
        assert not in_bf16 and "sqnr_db_float_part_bf16" not in quant
    hint = "bf16" if in_bf16 else "f32"
    assert result.manifest.formats["openvino"]["inference_precision_hint"] == hint
    with load(out, "openvino") as engine:
        assert engine.settings()["inference_precision"] == hint


def test_static_export_fixes_the_irs_input_shapes(exported):
    e = exported("mlp", OV, dynamic=False)
    assert e.manifest.status == "passed"
    batch = e.manifest.signature.dims["batch"]
    assert batch.min == batch.max == batch.opt
    xml = (e.root / XML).read_text()
    assert re.search(rf"<dim>{batch.opt}</dim>\s*<dim>8</dim>", xml), "the parameter's shape is fixed at opt"


class _ThreeInputs(torch.nn.Module):
    """Three weight products, each with its own input: ``a`` and ``b`` read unit-size activations,
    ``outlier`` one with a channel 50x the rest, whose weight column is 50x smaller (as a trained model's
    are), so the product is no larger while per-tensor rounding spends its steps on that channel."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.outlier = torch.nn.Linear(16, 16)
        self.register_buffer("gain", torch.ones(16))
        self.gain[5] = 50.0
        with torch.no_grad():
            self.outlier.weight[:, 5] /= 50.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(torch.tanh(x)) + self.outlier(x * self.gain)


def test_openvino_int8_costs_come_from_variants_of_one_quantized_ir_and_match_quantizing_each_alone():
    import nncf
    import openvino as ov

    from tk.export.int8.search import one_at_a_time_sqnr_db
    from tk.export.openvino.int8 import NncfUnits, ir_evaluator, weight_products

    torch.manual_seed(0)
    model = ov.convert_model(torch.export.export(_ThreeInputs().eval(), (torch.randn(32, 16),)))
    layers = weight_products(model)
    assert len(layers) == 3
    rng = np.random.default_rng(0)
    batches = [{model.inputs[0].get_any_name(): rng.standard_normal((32, 16)).astype(np.float32)} for _ in range(3)]
    dataset = nncf.Dataset(batches)
    transformer = nncf.ModelType.TRANSFORMER  # as tk quantizes models with attention: no elementwise quantizers
    quantized = nncf.quantize(model, dataset, subset_size=3, model_type=transformer)
    costs = one_at_a_time_sqnr_db(NncfUnits(model, quantized, layers), ir_evaluator(model, batches))
    judge = ir_evaluator(model, batches)
    alone = {  # the reference: NNCF quantizing that product only
        name: judge.sqnr_db(
            nncf.quantize(
                model,
                dataset,
                subset_size=3,
                model_type=transformer,
                ignored_scope=nncf.IgnoredScope([n for n in layers if n != name]),
            )
        )
        for name in layers
    }
    assert min(costs, key=costs.__getitem__) == min(alone, key=alone.__getitem__) == layers[2]  # the outlier's
    assert all(abs(costs[n] - alone[n]) < 3.0 for n in layers), (costs, alone)
    assert sum(op.get_type_name() == "FakeQuantize" for op in quantized.get_ordered_ops()) >= 2  # not changed


def test_smooth_quant_is_kept_or_not_by_the_worst_of_every_batch():
    """Under the target, NNCF's SmoothQuant on and off are both judged on every batch, calibration and held
    out, and the IR with the better worst batch is kept (not the better on the calibration batches alone)."""
    import openvino as ov

    from tk.export.openvino.int8 import _Nncf, _smooth_quant_kept, ir_evaluator

    torch.manual_seed(0)
    model = ov.convert_model(torch.export.export(_ThreeInputs().eval(), (torch.randn(32, 16),)))
    name = model.inputs[0].get_any_name()
    rng = np.random.default_rng(0)
    calibration = [{name: rng.standard_normal((32, 16)).astype(np.float32)} for _ in range(2)]
    held_out = [{name: 3.0 * rng.standard_normal((32, 16)).astype(np.float32)} for _ in range(2)]  # wider
    nncf_ = _Nncf(model, calibration, transformer=True)
    with_default = nncf_.quantize()
    evaluator = ir_evaluator(model, [*calibration, *held_out])
    kept, sqnr = _smooth_quant_kept(nncf_, with_default, evaluator, target=200.0)  # unreachable: both judged
    worst = {"nncf default": ir_evaluator(model, [*calibration, *held_out]).sqnr_db(with_default),
             "off": ir_evaluator(model, [*calibration, *held_out]).sqnr_db(_Nncf(model, calibration, True, "off").quantize())}  # fmt: skip
    assert nncf_.smooth_quant == max(worst, key=worst.__getitem__)
    assert sqnr == pytest.approx(max(worst.values()), abs=1e-6)
    assert evaluator.sqnr_db(kept) == pytest.approx(sqnr, abs=1e-6)  # its worst over all four batches


class _Encoder(torch.nn.Module):
    """An embedding table, one attention (q, k and v from a weight product each) and an output product:
    what NNCF quantizes in a transformer beyond its weight products (the table and attention's inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(64, 32)
        self.q, self.k, self.v, self.out = (torch.nn.Linear(32, 32) for _ in range(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        attended = torch.nn.functional.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x))
        return self.out(attended + x)


def test_openvino_int8_search_can_leave_out_attention_and_embedding_tables_as_well_as_weight_products():
    """The units the search may leave float32 are everything NNCF made int8: with all of them left out
    the IR is float32 again (before, a model with attention stayed under the floor with every weight
    product float32: the table and attention's quantizers were out of the search's reach)."""
    import nncf
    import openvino as ov

    from tk.export.int8.search import one_at_a_time_sqnr_db
    from tk.export.openvino.int8 import NncfUnits, ir_evaluator, quantized_units, weight_products

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 16))
    model = ov.convert_model(torch.export.export(_Encoder().eval(), (ids,)))
    rng = np.random.default_rng(0)
    name = model.inputs[0].get_any_name()
    batches = [{name: rng.integers(0, 64, (4, 16)).astype(np.int64)} for _ in range(3)]
    dataset = nncf.Dataset(batches)
    transformer = nncf.ModelType.TRANSFORMER
    quantized = nncf.quantize(model, dataset, subset_size=3, model_type=transformer)
    units = quantized_units(quantized, model)
    kinds = {op.get_friendly_name(): op.get_type_name() for op in quantized.get_ordered_ops()}
    assert set(weight_products(model)) <= set(units) and len(weight_products(model)) == 4
    assert sorted({kinds[u] for u in units}) == ["Gather", "MatMul", "ScaledDotProductAttention"]
    costs = one_at_a_time_sqnr_db(NncfUnits(model, quantized, units), ir_evaluator(model, batches))
    assert set(costs) == set(units) and all(np.isfinite(v) and v > 10.0 for v in costs.values()), costs
    judge = ir_evaluator(model, batches)
    everything_out = nncf.quantize(
        model, dataset, subset_size=3, model_type=transformer, ignored_scope=nncf.IgnoredScope(units)
    )
    assert not any(op.get_type_name() == "FakeQuantize" for op in everything_out.get_ordered_ops())
    assert judge.sqnr_db(everything_out) > 100.0  # float32 again (the judged SQNR of int8 is ~30-50 dB)
    assert judge.sqnr_db(quantized) < 60.0


class _SmallCnn(torch.nn.Module):
    """A convolution, a depthwise one (a GroupConvolution in OpenVINO), a 1x1 one and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pointwise = torch.nn.Conv2d(8, 16, 1)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.pointwise(torch.relu(self.depthwise(torch.relu(self.stem(x))))))
        return self.head(x.mean(dim=(2, 3)))


def test_openvino_int8_units_are_convolutions_too():
    """A CNN's units are its convolutions, its head and the pooling whose input NNCF quantizes (before, only
    MatMuls were: resnet18's search saw one layer, left it out, and the export failed as "no layer stayed
    int8" while NNCF's convolutions were int8). Their multiply-adds: output elements times each output's
    reduced inputs, 2 x 8 x 8 x 8 x 27 for the stem (3 channels x 3 x 3), 2 x 8 x 8 x 8 x 9 for the
    depthwise one (1 channel a group); none for the pooling. With all of them left out the IR is float32."""
    import nncf
    import openvino as ov

    from tk.export.int8.search import one_at_a_time_sqnr_db
    from tk.export.openvino.int8 import (
        NncfUnits,
        conv_shapes,
        ir_evaluator,
        quantized_units,
        unit_macs,
        weight_products,
    )

    torch.manual_seed(0)
    model = ov.convert_model(torch.export.export(_SmallCnn().eval(), (torch.randn(2, 3, 8, 8),)))
    name = model.inputs[0].get_any_name()
    rng = np.random.default_rng(0)
    batches = [{name: rng.standard_normal((2, 3, 8, 8)).astype(np.float32)} for _ in range(3)]
    dataset = nncf.Dataset(batches)
    quantized = nncf.quantize(model, dataset, subset_size=3)
    units = quantized_units(quantized, model)
    kinds = {op.get_friendly_name(): op.get_type_name() for op in model.get_ordered_ops()}
    assert set(weight_products(model)) < set(units)  # and the pooling, whose input NNCF quantized
    assert sorted(kinds[u] for u in units) == ["Convolution", "Convolution", "GroupConvolution", "MatMul", "ReduceMean"]
    macs = unit_macs(model, units, batches[0])
    assert [macs[u] for u in units] == [2 * 8 * 8 * 8 * 27, 2 * 8 * 8 * 8 * 9, 2 * 16 * 8 * 8 * 8, 0, 2 * 4 * 16]
    # the record the floor prices by: (inputs per group, outputs, kernel, groups, count) of the int8 ones
    assert conv_shapes(model, units) == [[1, 8, 3, 3, 8, 1], [3, 8, 3, 3, 1, 1], [8, 16, 1, 1, 1, 1]]
    assert conv_shapes(model, [u for u in units if kinds[u] != "GroupConvolution"]) == [
        [3, 8, 3, 3, 1, 1], [8, 16, 1, 1, 1, 1]
    ]  # fmt: skip
    costs = one_at_a_time_sqnr_db(NncfUnits(model, quantized, units), ir_evaluator(model, batches))
    judge = ir_evaluator(model, batches)
    assert set(costs) == set(units) and all(np.isfinite(v) for v in costs.values()), costs
    assert min(costs.values()) > judge.sqnr_db(quantized)  # one unit int8 loses less than all of them
    everything_out = nncf.quantize(model, dataset, subset_size=3, ignored_scope=nncf.IgnoredScope(units))
    assert judge.sqnr_db(everything_out) > 100.0  # float32 again


def test_openvino_units_multiply_adds_count_products_and_attention_at_the_batchs_shapes():
    """What the speed gate weighs a search's units by: each of _Encoder's four 32x32 products on 4 x 16
    tokens is 4*16*32*32 = 65,536 multiply-adds, attention (16 keys, q and v 32 wide) 4*16*16*(32+32)
    = 65,536, the embedding table none; at 2 x 8 tokens, a quarter and an eighth of that."""
    import nncf
    import openvino as ov

    from tk.export.openvino.int8 import quantized_units, unit_macs

    torch.manual_seed(0)
    model = ov.convert_model(torch.export.export(_Encoder().eval(), (torch.randint(0, 64, (4, 16)),)))
    name = model.inputs[0].get_any_name()
    rng = np.random.default_rng(0)
    batches = [{name: rng.integers(0, 64, (4, 16)).astype(np.int64)} for _ in range(2)]
    quantized = nncf.quantize(model, nncf.Dataset(batches), subset_size=2, model_type=nncf.ModelType.TRANSFORMER)
    units = quantized_units(quantized, model)
    kinds = {op.get_friendly_name(): op.get_type_name() for op in quantized.get_ordered_ops()}
    shape = str(model.inputs[0].get_partial_shape())
    macs = unit_macs(model, units, batches[0])
    assert {kinds[u]: macs[u] for u in units if kinds[u] != "MatMul"} == {
        "Gather": 0,
        "ScaledDotProductAttention": 65536,
    }
    assert [macs[u] for u in units if kinds[u] == "MatMul"] == [65536] * 4
    small = unit_macs(model, units, {name: batches[0][name][:2, :8]})
    assert all(small[u] * (8 if kinds[u] == "ScaledDotProductAttention" else 4) == macs[u] for u in units)
    assert str(model.inputs[0].get_partial_shape()) == shape  # reshaped a copy, not the model


def test_openvino_judge_runs_the_first_batches_whole_then_stops_at_the_first_under_the_target():
    import openvino as ov
    from openvino import opset13 as ops

    from tk.export.openvino.int8 import ir_evaluator

    x = ops.parameter([2, 4], np.float32, name="x")
    reference = ov.Model([ops.multiply(x, np.float32(1.0))], [x])
    shifted = ov.Model([ops.add(x, np.float32(0.01))], [x])  # SQNR: the batch's power over 0.01²
    rng = np.random.default_rng(0)
    scales = (1.0, 0.01, 1.0, 0.01, 1.0)  # batches 1 and 3: 40 dB under the others
    batches = [{"x": (s * rng.standard_normal((2, 4))).astype(np.float32)} for s in scales]
    judge = ir_evaluator(reference, batches)
    every = [ir_evaluator(reference, [b]).sqnr_db(shifted) for b in batches]
    assert every[1] < every[0] - 30 and every[3] < every[2] - 30
    target = every[1] + 10

    assert judge.sqnr_db(shifted, target_db=target) == pytest.approx(every[1], abs=1e-3)
    assert judge.stopped_at == 1  # no first batches to judge whole: stops at the first under the target
    assert judge.sqnr_db(shifted, target_db=target, judge_first=3) == pytest.approx(min(every[:3]), abs=1e-3)
    assert judge.stopped_at == 2 and judge.first_worst == pytest.approx(min(every[:3]), abs=1e-3)
    assert judge.sqnr_db(shifted, target_db=min(every) - 1, judge_first=1) == pytest.approx(min(every), abs=1e-3)
    assert judge.stopped_at == -1 and judge.first_worst == pytest.approx(every[0], abs=1e-3)  # all cleared it
