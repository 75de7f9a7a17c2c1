"""A user's model rebuilt as it was saved (issue #49, item 3): named outputs (dict, ModelOutput,
dataclass), ``FILE.py:callable``, a checkpoint's submodule versions, and default ranges within the
model's own limits."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tk.cli import cli
from tk.errors import UsageError
from tk.export import ExportOptions
from tk.manifest import read_manifest
from tk.models import build_model
from tk.models.checkpoint import VERSIONS_KEY, load_weights, saved_versions, state_dict_bytes
from tk.runtime import load
from tk.spec import Dim, random_feeds
from tk.workflows.export import export

MODELS = '''
import dataclasses

import torch
from torch import nn

from tk.models.user import UserModel


class Encoder(nn.Module):
    """Token and learned position embeddings (48 rows), a linear head; returns a dict."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(50, 16)
        self.pos_emb = nn.Embedding(48, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        hidden = self.tokens(ids) + self.pos_emb(positions)[None]
        return {"hidden": hidden, "logits": self.head(hidden).mean(1), "note": "not a tensor"}


def encoder():
    torch.manual_seed(0)
    return UserModel(Encoder(), {"ids": torch.randint(0, 50, (2, 12))}, dynamic_dims={"ids": {0: "batch", 1: "seq"}})


def logits_only():
    made = encoder()
    made.output_names = ["logits"]
    return made


def declared_limit():
    made = encoder()
    made.max_sizes = {"seq": 20}
    return made


@dataclasses.dataclass
class Scores:
    score: torch.Tensor
    label: str = "x"


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 2)

    def forward(self, x):
        return Scores(self.proj(x))


def scorer():
    torch.manual_seed(0)
    return Scorer()


class Strings(nn.Module):
    def forward(self, x):
        return [x, "text"]


def strings():
    return Strings()
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "nets.py").write_text(textwrap.dedent(MODELS))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_dict_output_is_named_by_its_tensor_keys_and_exports(user_dir):
    spec = build_model("pkg/nets.py:encoder")
    assert spec.name == "pkg.nets:encoder"
    assert [o.name for o in spec.signature.outputs] == ["hidden", "logits"]
    assert spec.signature.dims["seq"].max == 48, "the default range stops at the position table's 48 rows"
    result = export(spec, user_dir / "art", ExportOptions(formats=("torch", "onnx")))
    assert result.passed
    feeds = random_feeds(result.manifest.signature.inputs, {"batch": 3, "seq": 48})
    with load(user_dir / "art", "onnx") as engine:
        out = engine.run(feeds)
    with torch.no_grad():
        reference = spec.module(torch.from_numpy(feeds["ids"]))
    assert set(out) == {"hidden", "logits"} and out["logits"].shape == (3, 3)
    np.testing.assert_allclose(out["logits"], reference[1].numpy(), rtol=1e-4, atol=1e-5)


def test_output_names_pick_fields_of_a_named_result(user_dir):
    spec = build_model("pkg.nets:logits_only")
    assert [o.name for o in spec.signature.outputs] == ["logits"]
    with torch.no_grad():
        out = spec.module(torch.zeros(2, 5, dtype=torch.long))
    assert isinstance(out, tuple) and len(out) == 1 and out[0].shape == (2, 3)


def test_a_dataclass_output_exports_by_field_name(user_dir):
    spec = build_model("pkg.nets:scorer", input_descriptions=("x:float32:4x8",))
    assert [o.name for o in spec.signature.outputs] == ["score"]
    result = export(spec, user_dir / "art", ExportOptions(formats=("torch",)))
    assert result.passed and read_manifest(user_dir / "art").signature.outputs[0].name == "score"


def test_an_output_that_is_not_tensors_says_what_it_found(user_dir):
    with pytest.raises(UsageError, match="found a sequence holding Tensor, str"):
        build_model("pkg.nets:strings", input_descriptions=("x:float32:4x8",))


def test_a_declared_limit_caps_the_range_and_refuses_past_it(user_dir):
    spec = build_model("pkg.nets:declared_limit")
    assert spec.signature.dims["seq"].max == 20 and spec.max_sizes == {"seq": 20}
    with pytest.raises(UsageError, match="takes seq up to 20"):
        export(spec, user_dir / "art", ExportOptions(formats=("torch",), dims={"seq": Dim("seq", 1, 12, 32)}))


@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        ("pkg/missing.py:build", "pkg/missing.py is not a file"),
        ("pkg/nets.py", "names no callable after a colon"),
    ],
)
def test_a_file_path_that_cannot_work_is_one_line(user_dir, model, fragment):
    result = CliRunner().invoke(cli, ["export", model, "--input", "x:float32:4x8", "--out", str(user_dir / "o")])
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr and "Traceback" not in result.output, result.stderr


def test_mnasnet_rebuilds_from_its_checkpoint(tmp_path):
    """torchvision's MNASNet reads its version from the state_dict's _metadata: tk's checkpoints keep it."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    source = torchvision.models.mnasnet0_5(weights=None, num_classes=10).eval()
    data = state_dict_bytes(source)
    assert saved_versions(data)[""] == {"version": 2}, VERSIONS_KEY
    torch.manual_seed(1)
    target = torchvision.models.mnasnet0_5(weights=None, num_classes=10).eval()
    load_weights(target, data, source="weights.safetensors")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)
    from safetensors.torch import save_file  # a checkpoint saved elsewhere, without the versions: this code's own

    plain = tmp_path / "plain.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(plain))
    load_weights(target, plain)
    with torch.no_grad():
        torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)
