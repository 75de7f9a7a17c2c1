"""Static int8: calibrated QDQ graph, SQNR reported, the 35 dB floor kept by excluding costly layers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("onnxruntime")

from tk.cli import cli
from tk.errors import UsageError
from tk.export import ExportOptions
from tk.export.int8.calibration import calibration_batches
from tk.export.onnx.dynamic_int8 import weight_type
from tk.export.onnx.static_int8 import static_int8_onnx_from_onnx, weight_matmul_nodes
from tk.export.onnx.writer import OnnxOptions
from tk.models import build_model
from tk.spec import random_feeds
from tk.workflows.export import export


def _op_types(path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path)).graph.node]


@pytest.fixture(scope="module")
def fp32_onnx(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("int8") / "fp32"
    torch.manual_seed(0)
    export(
        build_model("transformer", size="tiny"),
        out,
        ExportOptions(formats=("onnx",), settings={"onnx": OnnxOptions(fusions=False)}),
    )
    return out / "model.onnx"


def _calibration(n: int = 16) -> list[dict[str, np.ndarray]]:
    spec = build_model("transformer", size="tiny")
    return calibration_batches(random_feeds(spec.signature.inputs, {"batch": n, "seq": 16}, seed=5))


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """The tiny Transformer after 100 training steps: random weights lose every layer to the int8
    floor (an export that then fails), a briefly trained model keeps most of them int8."""
    from tk.models.checkpoint import state_dict_bytes
    from tk.models.train import train

    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    train(spec, steps=100, seed=0)
    path = tmp_path_factory.mktemp("trained") / "transformer.safetensors"
    path.write_bytes(state_dict_bytes(spec.module))
    return path


@pytest.mark.slow
def test_static_int8_export_reports_its_sqnr_and_passes_the_floor(tmp_path, monkeypatch, caplog, trained_checkpoint):
    monkeypatch.setattr("tk.export.int8.calibration.JUDGE_SEEDS", 3)  # 3 judged batches per check shape: shorter
    out = tmp_path / "int8"
    caplog.set_level("INFO", logger="tk.export")
    options = ExportOptions(formats=("onnx",), precision="int8", checkpoint=trained_checkpoint)
    result = export(build_model("transformer", size="tiny"), out, options)
    assert result.passed
    quant = result.manifest.formats["onnx"]["quantization"]
    assert quant["mode"] == "static" and quant["method"] == "minmax" and quant["per_channel"]
    assert quant["sqnr_db_export"] >= 35.0 and quant["outputs"] == "float32"
    assert quant["weights"].split()[0] == weight_type()  # uint8 where this CPU's int8 products saturate
    assert result.manifest.formats["onnx"]["fusions"]["applied"]  # quantized after fusion
    report = result.manifest.check["onnx"]
    assert report["min_sqnr_db"] == 35.0
    assert min(o["sqnr_db"] for o in report["outputs"] if o["sqnr_db"] is not None) >= 35.0
    ops = _op_types(out / "model.onnx")
    assert "MultiHeadAttention" in ops  # quantized after fusion
    quantized = quant["quantizable_nodes"] - len(quant["excluded"])
    assert quantized >= 1 and ops.count("QuantizeLinear") == quantized  # activations only, products write float32
    assert f"export int8   {quantized} of {quant['quantizable_nodes']} layers int8" in caplog.text
    assert sum(count for _, _, count in quant["int8_linear_shapes"]) == quantized  # by weight shape, for the floor
    linears = {(m.in_features, m.out_features) for m in build_model("transformer", size="tiny").module.modules()
               if isinstance(m, torch.nn.Linear)}  # fmt: skip
    assert {(k, n) for k, n, _ in quant["int8_linear_shapes"]} <= linears


def test_layers_are_excluded_costliest_first_until_the_floor_holds(fp32_onnx, tmp_path):
    batches = _calibration()
    plain = static_int8_onnx_from_onnx(fp32_onnx, tmp_path / "plain.onnx", batches)
    assert plain.automatic == [] and plain.quantizable >= 5
    strict = static_int8_onnx_from_onnx(fp32_onnx, tmp_path / "strict.onnx", batches, min_sqnr_db=plain.sqnr_db + 3)
    assert strict.automatic, "a floor above the all-quantized SQNR must exclude layers"
    assert strict.sqnr_db > plain.sqnr_db
    costs = [strict.layer_sqnr_db[n] for n in strict.automatic]
    others = [v for n, v in strict.layer_sqnr_db.items() if n not in strict.automatic]
    assert len(strict.automatic) < plain.quantizable and others
    assert max(costs) <= min(others)  # the excluded layers are the costliest ones, measured alone
    assert len(strict.layer_sqnr_db) == plain.quantizable


def test_unit_macs_count_each_products_output_times_its_reduced_dimension(fp32_onnx):
    from tk.export.onnx.static_int8 import unit_macs

    spec = build_model("transformer", size="tiny")
    hidden, ffn = spec.module.blocks[0].ffn.up.in_features, spec.module.blocks[0].ffn.up.out_features
    feeds = random_feeds(spec.signature.inputs, {"batch": 3, "seq": 11}, seed=2)
    nodes = weight_matmul_nodes(fp32_onnx)
    graph = onnx.load(str(fp32_onnx)).graph
    weights = {i.name: tuple(i.dims) for i in graph.initializer}
    shape = {n.name: weights[n.input[1]] for n in graph.node if n.name in nodes}
    op = {n.name: n.op_type for n in graph.node}
    macs = unit_macs(fp32_onnx, nodes, feeds)
    assert set(macs) == set(nodes)
    rows = 3 * 11  # every token of every sample
    expected = {
        (hidden, 3 * hidden): rows * hidden * 3 * hidden,  # qkv: rows x K x N
        (hidden, hidden): rows * hidden * hidden,
        (hidden, ffn): rows * hidden * ffn,
        (ffn, hidden): rows * ffn * hidden,
        (2, hidden): 3 * hidden * 2,  # the head's Gemm (weight transposed): the first token of each sample
    }
    assert {shape[n] for n in nodes} == set(expected)
    assert all(macs[n] == expected[shape[n]] for n in nodes), macs
    assert op[next(n for n in nodes if shape[n] == (2, hidden))] == "Gemm"


def test_the_share_gate_ends_the_search_with_the_most_it_can_still_keep(fp32_onnx, tmp_path):
    from tk.errors import CannotWinError
    from tk.export.context import Int8Share

    batches = _calibration()
    plain = static_int8_onnx_from_onnx(fp32_onnx, tmp_path / "plain.onnx", batches)
    layers = plain.quantizable

    def search(stop_at: int) -> list[Int8Share]:
        asked: list[Int8Share] = []

        def share_gate(share: Int8Share) -> None:
            asked.append(share)
            if share.int8_layers <= stop_at:
                raise CannotWinError("onnx int8: cannot win here")

        with pytest.raises(CannotWinError):
            static_int8_onnx_from_onnx(
                fp32_onnx, tmp_path / "strict.onnx", batches, min_sqnr_db=plain.sqnr_db + 20, share_gate=share_gate
            )
        return asked

    # before the ranking: one layer out at least, at best the lightest (the head: 2 of its outputs per sample)
    (first,) = search(stop_at=layers - 1)
    assert first.bound and (first.int8_layers, first.layers) == (layers - 1, layers) and 0.99 < first.share < 1
    # after the first round under the target: its layer and the next in the ranking
    before, after_round = search(stop_at=layers - 2)
    assert before == first and after_round.bound and after_round.int8_layers == layers - 2
    assert 0 < after_round.share < first.share


def test_products_write_float32_so_onnxruntime_runs_matmul_integer_to_float(fp32_onnx, tmp_path):
    import onnxruntime as ort

    result = static_int8_onnx_from_onnx(fp32_onnx, tmp_path / "q.onnx", _calibration(8))
    assert result.to_json()["outputs"] == "float32" and result.to_json()["format"] == "QDQ"
    ops = _op_types(tmp_path / "q.onnx")
    assert ops.count("QuantizeLinear") == result.quantizable  # activations in, no outputs quantized
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(tmp_path / "q.onnx"), options, providers=["CPUExecutionProvider"])
    optimized = _op_types(tmp_path / "optimized.onnx")
    assert optimized.count("MatMulIntegerToFloat") >= result.quantizable - 1  # a Gemm may stay QDQ
    assert "QLinearMatMul" not in optimized


def test_nodes_to_exclude_stay_float32(fp32_onnx, tmp_path):
    nodes = weight_matmul_nodes(fp32_onnx)
    result = static_int8_onnx_from_onnx(fp32_onnx, tmp_path / "none.onnx", _calibration(8), nodes_to_exclude=nodes)
    assert result.excluded == nodes
    assert "DequantizeLinear" not in _op_types(tmp_path / "none.onnx")
    assert result.sqnr_db > 100  # nothing quantized: float32 up to reordering


def test_unknown_method_and_empty_calibration_are_usage_errors(fp32_onnx, tmp_path):
    with pytest.raises(UsageError, match="--calibration-method"):
        static_int8_onnx_from_onnx(fp32_onnx, tmp_path / "x.onnx", _calibration(8), method="mse")
    with pytest.raises(UsageError, match="at least one calibration sample"):
        static_int8_onnx_from_onnx(fp32_onnx, tmp_path / "x.onnx", [])


@pytest.mark.slow
def test_cli_calibrates_from_an_inputs_file_and_refuses_invalid_ones(tmp_path, monkeypatch, trained_checkpoint):
    monkeypatch.setattr("tk.export.int8.calibration.JUDGE_SEEDS", 3)
    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    feeds = random_feeds(spec.signature.inputs, {"batch": 16, "seq": 16}, seed=9)
    good = tmp_path / "calib.npz"
    np.savez(good, **feeds)
    out = tmp_path / "art"
    args = ["export", "transformer", "--size", "tiny", "--precision", "int8", "--out", str(out)]
    args += ["--checkpoint", str(trained_checkpoint)]
    result = CliRunner().invoke(cli, [*args, "--calibrate", str(good), "--calibration-method", "percentile"])
    assert result.exit_code == 0, result.output
    shown = CliRunner().invoke(cli, ["inspect", str(out)])
    assert "int8       onnx: static, QDQ, percentile; " in shown.output
    bad = tmp_path / "bad.npz"
    np.savez(bad, input_ids=feeds["input_ids"] + 5000, attention_mask=feeds["attention_mask"])
    result = CliRunner().invoke(cli, [*args, "--calibrate", str(bad)])
    assert result.exit_code == 2
    assert "outside the valid range" in result.output
    result = CliRunner().invoke(cli, [*args, "--calibrate", "random:zero"])
    assert result.exit_code == 2 and "--calibrate" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_histogram_methods_calibrate_on_random_inputs_and_uneven_files(
    tmp_path, monkeypatch, trained_checkpoint, method
):
    """onnxruntime stacks the histogram methods' activations across batches: random:N calibration
    (which otherwise cycles through sequence lengths) and a file of 13 samples must both work."""
    monkeypatch.setattr("tk.export.int8.calibration.JUDGE_SEEDS", 3)
    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    uneven = tmp_path / "calib.npz"
    np.savez(uneven, **random_feeds(spec.signature.inputs, {"batch": 13, "seq": 16}, seed=9))
    for i, calibrate in enumerate(("random:16", str(uneven))):
        out = tmp_path / f"art{i}"
        args = ["export", "transformer", "--size", "tiny", "--precision", "int8", "--out", str(out)]
        args += ["--checkpoint", str(trained_checkpoint)]
        result = CliRunner().invoke(cli, [*args, "--calibrate", calibrate, "--calibration-method", method])
        assert result.exit_code == 0, result.output
        shown = CliRunner().invoke(cli, ["inspect", str(out)])
        assert f"int8       onnx: static, QDQ, {method}; " in shown.output and "status: passed" in shown.output


def test_min_sqnr_sets_the_exclusion_target_and_the_checks_floor(tmp_path, monkeypatch):
    """An untrained model loses every layer to the 35 dB floor; with ``--min-sqnr`` below its
    all-int8 SQNR the export keeps them int8, and the floor travels in the manifest to ``tk check``."""
    monkeypatch.setattr("tk.export.int8.calibration.JUDGE_SEEDS", 3)
    out = tmp_path / "art"
    args = ["export", "transformer", "--size", "tiny", "--precision", "int8", "--no-fuse", "--out", str(out)]
    torch.manual_seed(0)
    result = CliRunner().invoke(cli, [*args, "--min-sqnr", "12"])
    assert result.exit_code == 0, result.output
    from tk.manifest import read_manifest

    manifest = read_manifest(out)
    quant = manifest.formats["onnx"]["quantization"]
    assert manifest.model["min_sqnr_db"] == 12.0
    assert manifest.check["onnx"]["min_sqnr_db"] == 12.0 and manifest.status == "passed"
    assert quant["sqnr_db_export"] >= 12.0 + 2.0 and len(quant["excluded"]) < quant["quantizable_nodes"]
    checked = CliRunner().invoke(cli, ["check", str(out), "--engine", "onnx", "--json", str(tmp_path / "c.json")])
    assert checked.exit_code == 0, checked.output
    import json

    assert json.loads((tmp_path / "c.json").read_text())["onnx"]["min_sqnr_db"] == 12.0


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--precision", "fp32", "--min-sqnr", "20"], "--min-sqnr: applies to --precision int8/bf16/fp16/tf32"),
        (["--precision", "int8", "--min-sqnr", "nan"], "--min-sqnr: expected a finite number of dB, got nan"),
    ],
)
def test_min_sqnr_is_refused_where_it_means_nothing(tmp_path, extra, says):
    result = CliRunner().invoke(cli, ["export", "transformer", "--size", "tiny", "--out", str(tmp_path / "a"), *extra])
    assert result.exit_code == 2 and says in result.output and not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    ("calibration", "sizes"),
    [(None, [4] * 8), (10, [4, 4]), (3, None)],
    ids=["random", "file-short-last-batch-left-out", "file-smaller-than-the-batch"],
)
def test_a_static_batch_calibrates_in_batches_of_its_size(tmp_path, calibration, sizes):
    """A static batch dimension takes one size: calibration batches of 8 made onnxruntime refuse the graph's inputs."""
    from tk.export.context import ExportContext
    from tk.export.int8.calibration import calibration_feeds
    from tk.spec import Dim

    spec = build_model("transformer", size="tiny")
    data = None
    if calibration is not None:
        data = random_feeds(spec.signature.inputs, {"batch": calibration, "seq": 16}, seed=3)
    options = ExportOptions(formats=("onnx",), precision="int8", calibration_data=data)
    dims = {"batch": Dim("batch", 4, 4, 4), "seq": Dim("seq", 16, 16, 16)}
    ctx = ExportContext(spec, spec.module, dims, options, tmp_path, ())
    if sizes is None:
        with pytest.raises(UsageError, match="takes at least 4 samples; the file holds 3"):
            calibration_feeds(ctx)
        return
    assert [b["input_ids"].shape for b in calibration_feeds(ctx)] == [(n, 16) for n in sizes]
    assert [b["input_ids"].shape for b in calibration_feeds(ctx, one_shape=True)] == [(n, 16) for n in sizes]


@pytest.mark.slow
def test_static_int8_export_at_a_static_batch_passes(tmp_path):
    torch.manual_seed(0)
    out = tmp_path / "static"
    args = ["export", "transformer", "--size", "tiny", "--precision", "int8", "--batch", "4", "--seq", "16"]
    result = CliRunner().invoke(cli, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    from tk.manifest import read_manifest

    manifest = read_manifest(out)
    assert manifest.signature.dims["batch"].min == manifest.signature.dims["batch"].max == 4
    assert manifest.formats["onnx"]["quantization"]["mode"] == "static"


def test_the_judge_runs_the_float_graph_only_on_the_batches_it_judges(fp32_onnx, tmp_path):
    """References are computed when a batch is first judged, in one float32 session its head shares: a
    graph under the target on its first batch leaves the other batches' references uncomputed."""
    from tk.export.onnx.static_int8 import graph_evaluator

    batches = _calibration(32)
    assert len(batches) >= 3
    quantized = tmp_path / "int8.onnx"
    static_int8_onnx_from_onnx(fp32_onnx, quantized, batches[:2])
    judge = graph_evaluator(fp32_onnx, batches)
    first = judge.sqnr_db(quantized, target_db=1000.0)  # int8 is under 1000 dB on its first batch
    assert 10 < first < 100 and sorted(judge.references) == [0] and judge.runner.float_run is not None
    session = judge.runner.float_run
    head = judge.subset(range(2))
    assert head.sqnr_db(fp32_onnx) == float("inf") and sorted(judge.references) == [0, 1]
    assert head.runner.float_run is session
    full = judge.sqnr_db(quantized)
    assert sorted(judge.references) == list(range(len(batches))) and judge.runner.float_run is session
    assert full <= first and full == graph_evaluator(fp32_onnx, batches).sqnr_db(quantized)


class _SmallCnn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.depthwise(torch.relu(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


def test_convolutions_are_layers_and_write_int8_for_onnxruntimes_qlinear_conv(tmp_path):
    """A CNN's convolutions are quantized (before, only MatMul/Gemm were: resnet18's onnx int8 ran its
    convolutions in float32, no faster than the float32 graph); a Conv writes int8, so onnxruntime fuses each
    into QLinearConv; its multiply-adds are output elements times input channels per group times kernel."""
    import onnxruntime as ort

    from tk.export.onnx.static_int8 import conv_shapes, unit_macs

    torch.manual_seed(0)
    source = tmp_path / "cnn.onnx"
    torch.onnx.export(_SmallCnn().eval(), (torch.randn(2, 3, 8, 8),), str(source), input_names=["x"], dynamo=True)
    nodes = weight_matmul_nodes(source)
    kinds = {n.name: n.op_type for n in onnx.load(str(source)).graph.node}
    assert sorted(kinds[n] for n in nodes) == ["Conv", "Conv", "Gemm"]
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)} for _ in range(3)]
    macs = unit_macs(source, nodes, batches[0])
    assert sorted(macs.values()) == [2 * 4 * 8, 2 * 8 * 8 * 8 * 9, 2 * 8 * 8 * 8 * 27]
    target = tmp_path / "int8.onnx"
    result = static_int8_onnx_from_onnx(source, target, batches)
    assert result.quantizable == 3 and result.automatic == [] and result.sqnr_db > 25.0
    # what the floor prices in int8: (inputs per group, outputs, kernel, groups, count), the depthwise first
    assert result.to_json()["int8_conv_shapes"] == [[1, 8, 3, 3, 8, 1], [3, 8, 3, 3, 1, 1]]
    grouped = {
        n.name for n in onnx.load(str(source)).graph.node if any(a.name == "group" and a.i > 1 for a in n.attribute)
    }
    assert conv_shapes(source, [n for n in nodes if n not in grouped]) == [[3, 8, 3, 3, 1, 1]]
    graph = onnx.load(str(target)).graph
    produced_by = {o: n for n in graph.node for o in n.output}
    read_by = {i: n for n in graph.node for i in n.input}
    for conv in (n for n in graph.node if n.op_type == "Conv"):
        assert all(produced_by[i].op_type == "DequantizeLinear" for i in conv.input[:2])  # activation and weight
        assert read_by[conv.output[0]].op_type == "QuantizeLinear"  # its output quantized too
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(target), options, providers=["CPUExecutionProvider"])
    assert [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node].count("QLinearConv") == 2
