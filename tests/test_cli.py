"""The command line: exit codes and one-line messages, through click's CliRunner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tk.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def assert_one_line_error(result, code: int, *fragments: str) -> None:
    assert result.exit_code == code, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_models_lists_every_builtin():
    result = invoke("models", "--json")
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    assert {r["name"] for r in rows} == {"transformer", "decoder", "linear", "mlp", "resnet18"}
    assert all(r["sizes"] == ["tiny", "small", "base"] for r in rows if r["name"] != "decoder")
    assert next(r["sizes"] for r in rows if r["name"] == "decoder") == ["tiny", "small", "medium", "base"]


def test_unknown_model_name():
    assert_one_line_error(invoke("export", "bert"), 2, "unknown model 'bert'", "transformer")


def test_module_callable_that_does_not_import():
    assert_one_line_error(invoke("train", "no_such_package.models:build"), 2, "cannot import 'no_such_package.models'")


def test_module_callable_missing_attribute():
    assert_one_line_error(invoke("export", "examples.user_model:nothing"), 2, "has no attribute 'nothing'")


@pytest.mark.parametrize(
    "description, fragment",
    [
        ("features", "expected NAME:DTYPE:SHAPE"),
        ("features:float33:4x16", "expected a dtype"),
        ("features:float32:4xx16", "expected NAME:DTYPE:SHAPE"),
        ("features:float32:0x16", "sizes of at least 1"),
        ("features:float32:4x8", "forward failed"),
    ],
)
def test_bad_input_description(description, fragment):
    result = invoke("export", "examples.user_model:regressor", "--input", description, "--format", "torch")
    assert_one_line_error(result, 2, fragment)


def test_user_model_without_inputs_asks_for_them():
    assert_one_line_error(invoke("export", "examples.user_model:regressor"), 2, "--input NAME:DTYPE:SHAPE")


def test_bad_dimension_range():
    assert_one_line_error(invoke("export", "transformer", "--size", "tiny", "--batch", "8:1:2"), 2, "min <= opt <= max")


def test_debug_shows_the_traceback():
    result = CliRunner().invoke(cli, ["--debug", "export", "bert"])
    assert result.exit_code != 0
    assert result.exception is not None and "unknown model" in str(result.exception)


def test_train_writes_a_checkpoint_and_sidecar(tmp_path):
    out = tmp_path / "lin.safetensors"
    result = invoke("train", "linear", "--size", "tiny", "--out", str(out))
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "lin.safetensors.json").read_text())
    assert meta["name"] == "linear" and meta["train"]["final_loss"] < 1e-3
    assert meta["versions"]["torch"]


def test_the_same_seed_trains_the_same_weights_and_compare_saves_nothing(tmp_path):
    from safetensors.torch import load_file

    paths = [tmp_path / f"mlp-{i}.safetensors" for i in range(3)]
    for path, seed in zip(paths, ("0", "0", "1"), strict=True):
        result = invoke("train", "mlp", "--size", "tiny", "--steps", "5", "--seed", seed, "--out", str(path))
        assert result.exit_code == 0, result.output
    first, again, other = (load_file(p) for p in paths)
    assert all(torch.equal(first[k], again[k]) for k in first)  # --seed seeds the initial weights too
    assert any(not torch.equal(first[k], other[k]) for k in first)
    compare = invoke("train", "mlp", "--size", "tiny", "--compare", "--out", str(tmp_path / "c.safetensors"))
    assert_one_line_error(
        compare, 2, "--out: --compare trains two copies to compare their speed and saves no checkpoint"
    )


def test_train_user_model_has_no_task():
    assert_one_line_error(invoke("train", "examples.user_model:scorer"), 2, "no training task")


def test_export_and_inspect_a_user_model(tmp_path):
    out = tmp_path / "scorer"
    result = invoke("export", "examples.user_model:scorer", "--format", "torch", "--out", str(out))
    assert result.exit_code == 0, result.output
    shown = invoke("inspect", str(out))
    assert shown.exit_code == 0
    assert "tokens: int64[batch, seq]" in shown.stdout and "status: passed" in shown.stdout


def test_python_dash_m_tk_works_without_installing():
    done = subprocess.run([sys.executable, "-m", "tk", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "export" in done.stdout


def test_import_tk_cli_stays_light():
    code = "import sys, tk, tk.cli, tk.errors; print(sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'tensorrt') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_user_code_named_by_an_artifact_runs_only_when_trusted(tmp_path, monkeypatch):
    out = tmp_path / "scorer"
    assert invoke("export", "examples.user_model:scorer", "--format", "torch", "--out", str(out)).exit_code == 0
    own = invoke("check", str(out), "--engine", "torch")  # signed with the user's own key: trusted
    assert own.exit_code == 0, own.output
    from tk.keys import ensure_own_key

    signer = ensure_own_key()[1]
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "another-user"))  # someone else receives it
    refused = invoke("check", str(out), "--engine", "torch")
    assert_one_line_error(refused, 2, "user code", "--trust-model-code", "--public-key")
    for flags in (["--trust-model-code"], ["--public-key", str(signer)]):
        trusted = invoke("check", str(out), "--engine", "torch", *flags)
        assert trusted.exit_code == 0, trusted.output
        assert "parity passed for torch" in trusted.stdout


# -- engine flags: each applies to the engines that declare it, never silently dropped ---------------
@pytest.mark.parametrize(
    "engine, flag, message",
    [
        ("torch", ["--provider", "CPUExecutionProvider"], "--provider applies to the onnx engine, not torch"),
        ("onnx", ["--mode", "max-autotune"], "--mode applies to the compile engine, not onnx"),
        ("onnx", ["--streams", "2"], "--streams applies to the openvino engine, not onnx"),
        ("onnx", ["--cuda-graph"], "--cuda-graph applies to the eager, compile, torch, aoti and trt engines, not onnx"),
        ("onnx", ["--trust-model-code"], "--trust-model-code applies to the eager and compile engines, not onnx"),
    ],
)
def test_infer_refuses_an_engine_flag_its_engine_does_not_take(exported, tmp_path, engine, flag, message):
    root = exported("linear", ("torch", "onnx")).root
    out = tmp_path / "out.npz"
    result = invoke("infer", str(root), "--engine", engine, *flag, "--random", "2", "--out", str(out))
    assert_one_line_error(result, 2, message)
    assert not out.exists()


def test_infer_with_a_flag_its_engine_takes_runs(exported, tmp_path):
    root = exported("linear", ("torch", "onnx")).root
    out = tmp_path / "out.npz"
    result = invoke(
        "infer",
        str(root),
        "--engine",
        "onnx",
        "--provider",
        "cpu",
        "--threads",
        "1",
        "--random",
        "3",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    with np.load(out) as arrays:
        assert arrays["y"].shape[0] == 3


def test_infer_auto_refuses_a_flag_none_of_the_engines_here_takes(exported, tmp_path):
    root = exported("linear", ("torch",)).root  # no onnx file: auto's candidates are eager, compile and torch
    result = invoke(
        "infer", str(root), "--engine", "auto", "--provider", "cpu", "--random", "2", "--out", str(tmp_path / "o.npz")
    )
    assert_one_line_error(result, 2, "--provider applies to the onnx engine, not eager, compile, torch")


def test_check_applies_a_flag_to_the_reference_and_the_engines_compared(exported):
    root = exported("linear", ("torch", "onnx")).root
    refused = invoke("check", str(root), "--engine", "torch", "--provider", "cpu")
    assert_one_line_error(refused, 2, "--provider applies to the onnx engine, not eager, torch")
    refused = invoke("check", str(root), "--engine", "torch", "--mode", "max-autotune")
    assert_one_line_error(refused, 2, "--mode applies to the compile engine, not eager, torch")
    passed = invoke("check", str(root), "--engine", "torch,onnx", "--provider", "cpu", "--samples", "4")
    assert passed.exit_code == 0, passed.output
    assert "parity passed for torch, onnx" in passed.output
    trusted = invoke("check", str(root), "--engine", "onnx", "--trust-model-code", "--samples", "4")  # eager takes it
    assert trusted.exit_code == 0, trusted.output


def test_check_all_refuses_a_flag_none_of_the_artifacts_engines_takes(exported):
    root = exported("linear", ("torch",)).root
    result = invoke("check", str(root), "--engine", "all", "--provider", "cpu")
    assert_one_line_error(result, 2, "--provider applies to the onnx engine, not eager, compile, torch")


def test_bench_applies_a_flag_to_the_engines_and_baselines_it_times(exported, tmp_path):
    root = exported("linear", ("torch", "onnx")).root
    common = ["--no-baselines", "--iters", "1", "--warmup", "0", "--batch-sizes", "1"]
    refused = invoke("bench", str(root), "--engine", "torch", "--provider", "cpu", *common)
    assert_one_line_error(refused, 2, "--provider applies to the onnx engine, not torch")
    refused = invoke("bench", str(root), "--engine", "onnx", "--mode", "max-autotune", *common)
    assert_one_line_error(refused, 2, "--mode applies to the compile engine, not onnx")
    out = tmp_path / "bench.json"
    timed = invoke("bench", str(root), "--engine", "onnx", "--provider", "cpu", *common, "--json", str(out))
    assert timed.exit_code == 0, timed.output
    settings = json.loads(out.read_text())["settings"]["engines"]["onnx"]
    assert settings["provider"] == "cpu" and settings["spinning"] is True  # one engine: onnxruntime's default


def test_bench_compiles_for_static_shapes_when_asked(exported, tmp_path):
    root = exported("linear", ("torch",)).root
    common = ["--iters", "1", "--warmup", "0", "--batch-sizes", "1,3"]
    refused = invoke("bench", str(root), "--engine", "torch", "--static", "--no-baselines", *common)
    assert_one_line_error(refused, 2, "--dynamic/--static applies to the compile engine, not torch")
    runs = {}
    for flag in ("--static", "--dynamic"):
        out = tmp_path / f"bench{flag}.json"
        timed = invoke("bench", str(root), "--engine", "compile", flag, "--no-baselines", *common, "--json", str(out))
        assert timed.exit_code == 0, timed.output
        runs[flag] = json.loads(out.read_text())
    assert runs["--static"]["settings"]["engines"]["compile"]["dynamic"] is False
    assert runs["--dynamic"]["settings"]["engines"]["compile"]["dynamic"] is True
    assert {row["batch_size"] for row in runs["--static"]["results"]["rows"]} == {1, 3}


def test_serve_refuses_a_flag_its_engine_does_not_take_before_starting(exported):
    pytest.importorskip("ray")
    root = exported("linear", ("torch", "onnx")).root
    result = invoke("serve", str(root), "--engine", "torch", "--provider", "cpu")
    assert_one_line_error(result, 2, "--provider applies to the onnx engine, not torch")


def test_threads_below_one_is_refused_by_every_engine_command(exported, tmp_path):
    root = exported("linear", ("torch", "onnx")).root
    for args in (["infer", str(root), "--random", "1", "--out", str(tmp_path / "o.npz")], ["check", str(root)]):
        assert_one_line_error(
            invoke(*args, "--threads", "0"), 2, "Invalid value for '--threads': 0 is not in the range 1<=x<=1024"
        )


def test_infer_ray_refuses_a_flag_its_engine_does_not_take_before_ray_starts(exported, tmp_path):
    pytest.importorskip("ray")
    root = exported("linear", ("torch", "onnx")).root
    shards = tmp_path / "shards"
    shards.mkdir()
    np.savez(shards / "a.npz", x=np.zeros((2, 16), np.float32))
    args = ["infer", str(root), "--ray", "--inputs", str(shards), "--out", str(tmp_path / "out")]
    assert_one_line_error(
        invoke(*args, "--engine", "torch", "--mode", "max-autotune"),
        2,
        "--mode applies to the compile engine, not torch",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "preset", "expected"),
    [(["models"], None, "-all"), (["models"], "+dynamo", "+dynamo"), (["--debug", "models"], None, None)],
)
def test_torch_logs_are_quiet_unless_debug_or_the_user_set_them(args, preset, expected):
    code = (
        "import os, sys\n"
        "from tk.cli import main\n"
        f"sys.argv = ['tk', *{args!r}]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('TORCH_LOGS=' + str(os.environ.get('TORCH_LOGS')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"} | ({"TORCH_LOGS": preset} if preset else {})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == f"TORCH_LOGS={expected}", done.stdout + done.stderr


def test_a_reader_that_goes_away_ends_tk_quietly(tmp_path):
    out = tmp_path / "mlp"
    assert invoke("export", "mlp", "--size", "tiny", "--format", "torch", "--out", str(out)).exit_code == 0
    command = [sys.executable, "-m", "tk", "inspect", str(out), "--json"]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # `tk inspect A | head -0`: gone before tk writes (it takes a second to start)
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=120)
    assert code == 141 and "error" not in err and "Traceback" not in err, (code, err)


def test_check_against_eager_alone_says_eager_is_the_reference(tmp_path):
    out = tmp_path / "mlp"
    assert invoke("export", "mlp", "--size", "tiny", "--format", "torch", "--out", str(out)).exit_code == 0
    result = invoke("check", str(out), "--engine", "eager")
    assert_one_line_error(result, 2, "eager is the reference each engine is compared with")


def test_outputs_inside_the_artifact_read_or_written_are_refused(tmp_path):
    art = tmp_path / "mlp"
    assert invoke("export", "mlp", "--size", "tiny", "--format", "onnx", "--out", str(art)).exit_code == 0
    before = {p.name: p.read_bytes() for p in art.iterdir()}
    for args, flag in [
        (["check", str(art), "--engine", "onnx", "--json", str(art / "manifest.json")], "--json"),
        (["check", str(art), "--engine", "onnx", "--save-golden", str(art / "weights.safetensors")], "--save-golden"),
        (["check", str(art), "--engine", "onnx", "--junit", str(art / "model.sig")], "--junit"),
        (["bench", str(art), "--engine", "onnx", "--plot", str(art / "model.onnx")], "--plot"),
        (["bench", str(art), "--engine", "onnx", "--save-baseline", str(art / "b.json")], "--save-baseline"),
        (["infer", str(art), "--random", "2", "--out", str(art / "o.npz")], "--out"),
        (
            ["export", "mlp", "--size", "tiny", "--out", str(tmp_path / "b"), "--json", str(tmp_path / "b" / "m.json")],
            "--json",
        ),
    ]:
        assert_one_line_error(invoke(*args), 2, f"{flag}: expected a path outside the artifact")
    train = invoke("train", "mlp", "--size", "tiny", "--steps", "2", "--out", str(art / "weights.safetensors"))
    assert_one_line_error(train, 2, "--out: expected a path outside a tk artifact")
    assert {p.name: p.read_bytes() for p in art.iterdir()} == before  # nothing of the artifact was touched
    webapp = tmp_path / "webapp"  # another tool's manifest.json is no artifact
    webapp.mkdir()
    (webapp / "manifest.json").write_text('{"name": "a web app"}')
    ok = invoke("train", "mlp", "--size", "tiny", "--steps", "2", "--out", str(webapp / "m.safetensors"))
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--seed", "-1"], "Invalid value for '--seed': -1 is not in the range"),
        (["--threads", "100000"], "Invalid value for '--threads': 100000 is not in the range"),
    ],
)
def test_seeds_and_thread_counts_out_of_range_are_one_line(tmp_path, args, says):
    result = invoke("infer", str(tmp_path / "none"), "--random", "2", "--out", str(tmp_path / "o.npz"), *args)
    assert_one_line_error(result, 2, says)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--compile", "--backend", "nosuch"], "--backend: expected a torch.compile backend such as inductor"),
        (["--batch-size", "99999999999"], "--batch-size 99999999999: a training batch needs more memory"),
    ],
)
def test_training_settings_the_machine_cannot_run_are_one_line(tmp_path, args, says):
    result = invoke("train", "mlp", "--size", "tiny", "--steps", "2", "--out", str(tmp_path / "m.safetensors"), *args)
    assert_one_line_error(result, 2, says)
    assert not (tmp_path / "m.safetensors").exists()
