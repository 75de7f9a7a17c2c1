"""Padding removed between attentions (``tk.export.aoti.unpadded``): the linears run on real tokens only, and
every real token's values are what the padded program computes."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tk.export.aoti.unpadded import PADDING_REMOVED, padded_example, padding_removed, removable_mask
from tk.export.capture import exported_program_from_module
from tk.spec import Dim, Signature, TensorSpec

BATCH, SEQ, WIDTH = 3, 12, 16
DIMS = {"batch": Dim("batch", 1, BATCH, 8), "seq": Dim("seq", 2, SEQ, 32)}
SIGNATURE = Signature(
    [
        TensorSpec("input_ids", "int64", ("batch", "seq"), kind="ids", low=0, high=50),
        TensorSpec("attention_mask", "int64", ("batch", "seq"), kind="mask", low=0, high=2),
    ],
    [TensorSpec("hidden", "float32", ("batch", "seq", WIDTH)), TensorSpec("pooled", "float32", ("batch", WIDTH))],
    DIMS,
)


class Encoder(nn.Module):
    """A BERT layer's shape: embeddings with positions, masked attention, residuals, LayerNorms, a GELU
    feed-forward; the hidden states and their mean over real tokens. ``masked=False``: attention sees padding;
    ``per_sequence``: a (batch, 1, width) vector added to every token."""

    def __init__(self, masked: bool = True, per_sequence: bool = False) -> None:
        super().__init__()
        self.words, self.positions = nn.Embedding(50, WIDTH), nn.Embedding(32, WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.masked, self.per_sequence = masked, per_sequence

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq = ids.shape
        x = self.words(ids) + self.positions(torch.arange(seq))[None]
        if self.per_sequence:  # a linear's output (on real tokens) plus a vector per sequence
            x = self.out(x) + x.mean(dim=1, keepdim=True)
        q, k, v = self.qkv(x).view(batch, seq, 3, 2, WIDTH // 2).permute(2, 0, 3, 1, 4)
        keys = mask.bool()[:, None, None, :] if self.masked else None
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keys)
        x = self.norm1(x + self.out(attended.transpose(1, 2).reshape(batch, seq, WIDTH)))
        x = self.norm2(x + self.down(nn.functional.gelu(self.up(x))))
        weights = mask[..., None].to(x.dtype)
        return x, (x * weights).sum(1) / weights.sum(1)


def _program(module: nn.Module) -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    example = (torch.randint(0, 50, (BATCH, SEQ)), torch.ones(BATCH, SEQ, dtype=torch.int64))
    return exported_program_from_module(module.eval(), example, SIGNATURE, DIMS)


def _feeds(batch: int, seq: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    return torch.randint(0, 50, (batch, seq)) * mask, mask


def _linear_rows(program: torch.export.ExportedProgram) -> list[object]:
    """The first size of each linear's input, as the program holds it (a symbol or an int)."""
    return [n.args[0].meta["val"].shape[0] for n in program.graph.nodes if n.target is torch.ops.aten.linear.default]


def test_the_linears_run_on_real_tokens_and_real_tokens_keep_their_values():
    torch.manual_seed(0)
    model = Encoder()
    program = _program(model)
    example = (torch.randint(0, 50, (BATCH, SEQ)), torch.ones(BATCH, SEQ, dtype=torch.int64))
    unpadded = padding_removed(program, SIGNATURE, DIMS, example)
    assert unpadded is not None

    mask_name = program.graph_signature.user_inputs[1]
    batch = next(n for n in program.graph.nodes if n.name == mask_name).meta["val"].shape[0]
    assert all(str(rows) != str(batch) for rows in _linear_rows(unpadded))  # real tokens, not batch * seq rows
    assert len(_linear_rows(unpadded)) == 4

    for lengths, seq in (([12, 5, 1], 12), ([20, 20, 7, 3, 9], 20), ([4], 4)):
        ids, mask = _feeds(len(lengths), seq, lengths)
        with torch.no_grad():
            (hidden, pooled), (got_hidden, got_pooled) = model(ids, mask), unpadded.module()(ids, mask)
        real = mask.bool()
        torch.testing.assert_close(got_hidden[real], hidden[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_pooled, pooled, rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(got_hidden[~real]) == 0  # nothing computed at padding


def test_a_model_whose_attention_sees_padding_keeps_it(caplog):
    program = _program(Encoder(masked=False))
    example = (torch.randint(0, 50, (BATCH, SEQ)), torch.ones(BATCH, SEQ, dtype=torch.int64))
    assert removable_mask(program, SIGNATURE) == 1  # it has a mask and linears over tokens: a candidate
    with caplog.at_level(logging.INFO, logger="tk"):
        assert padding_removed(program, SIGNATURE, DIMS, example) is None
    assert "padding kept" in caplog.text and "max abs error" in caplog.text


def test_a_value_per_sequence_sends_its_sum_back_to_the_padded_layout():
    torch.manual_seed(0)
    model = Encoder(per_sequence=True)
    example = (torch.randint(0, 50, (BATCH, SEQ)), torch.ones(BATCH, SEQ, dtype=torch.int64))
    unpadded = padding_removed(_program(model), SIGNATURE, DIMS, example)
    assert unpadded is not None
    ids, mask = _feeds(3, 12, [12, 5, 2])
    with torch.no_grad():
        (hidden, _), (got, _) = model(ids, mask), unpadded.module()(ids, mask)
    torch.testing.assert_close(got[mask.bool()], hidden[mask.bool()], rtol=1e-5, atol=1e-5)


def test_a_static_program_or_one_without_a_mask_is_left_alone():
    example = (torch.randint(0, 50, (BATCH, SEQ)), torch.ones(BATCH, SEQ, dtype=torch.int64))
    static = {n: Dim(n, d.opt, d.opt, d.opt) for n, d in DIMS.items()}
    program = exported_program_from_module(Encoder().eval(), example, SIGNATURE, static)
    assert removable_mask(program, SIGNATURE) is None
    no_mask = Signature([SIGNATURE.inputs[0], TensorSpec("mask", "int64", ("batch", "seq"))], SIGNATURE.outputs, DIMS)
    assert removable_mask(_program(Encoder()), no_mask) is None


def test_the_example_is_padded_on_the_right_with_one_row_of_at_least_one_token():
    ids, mask = torch.zeros(4, 8, dtype=torch.int64), torch.ones(4, 8, dtype=torch.int64)
    _, padded = padded_example((ids, mask), 1)
    assert padded.sum(1).tolist() == [7, 6, 5, 4]
    assert padded_example((ids[:, :1], mask[:, :1]), 1) is None


@pytest.mark.slow
def test_a_float_package_names_the_pass_and_keep_padding_leaves_it_out(tmp_path):
    from tk.export import ExportOptions
    from tk.export.aoti.writer import AotiOptions
    from tk.models import build_model
    from tk.workflows.export import export

    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    removed = export(spec, tmp_path / "removed", ExportOptions(formats=("aoti",), precision="bf16")).manifest
    assert removed.status == "passed", removed.check  # bf16 against float32 PyTorch, at real tokens
    assert PADDING_REMOVED in removed.formats["aoti"]["graph_passes"]
    kept = export(
        spec,
        tmp_path / "kept",
        ExportOptions(formats=("aoti",), precision="bf16", settings={"aoti": AotiOptions(remove_padding=False)}),
    ).manifest
    assert kept.status == "passed", kept.check
    assert PADDING_REMOVED not in kept.formats["aoti"]["graph_passes"]


@pytest.mark.slow
def test_a_rewrite_that_does_not_compile_keeps_the_padding(tmp_path, monkeypatch, caplog):
    """The program on real tokens fails AOTInductor's compile: the package is the padded program's."""
    from tk.errors import ConversionError
    from tk.export import ExportOptions
    from tk.export.aoti import writer
    from tk.models import build_model
    from tk.workflows.export import export

    compiled = writer.aoti_package_from_exported_program
    calls = []

    def first_fails(program, *args, **kwargs):
        calls.append(program)
        if len(calls) == 1:
            raise ConversionError("AOTInductor could not compile the program (planted)")
        return compiled(program, *args, **kwargs)

    monkeypatch.setattr(writer, "aoti_package_from_exported_program", first_fails)
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="tk"):
        manifest = export(build_model("transformer", size="tiny"), tmp_path / "out",
                          ExportOptions(formats=("aoti",), precision="bf16")).manifest  # fmt: skip
    assert len(calls) == 2 and calls[0] is not calls[1]  # the rewritten program, then the one it came from
    assert manifest.status == "passed", manifest.check
    assert PADDING_REMOVED not in manifest.formats["aoti"].get("graph_passes", [])
    assert "padding kept: the program on real tokens did not compile" in caplog.text


def test_keep_padding_is_refused_where_the_pass_never_runs():
    from tk.errors import UsageError
    from tk.export import ExportOptions
    from tk.export.aoti.writer import WRITER, AotiOptions

    with pytest.raises(UsageError, match="applies to CPU packages only; this export is for cuda"):
        WRITER.validate(AotiOptions(remove_padding=False), ExportOptions(precision="bf16", device="cuda"))


def test_a_rewrite_that_cannot_be_captured_keeps_the_padding(monkeypatch, caplog):
    from tk.errors import CaptureError

    def refuse(*args, **kwargs):
        raise CaptureError("torch.export could not capture the model as one graph (GuardOnDataDependentSymNode)")

    monkeypatch.setattr("tk.export.aoti.unpadded.exported_program_from_module", refuse)
    example = (torch.randint(0, 50, (BATCH, SEQ)), torch.ones(BATCH, SEQ, dtype=torch.int64))
    with caplog.at_level(logging.INFO, logger="tk"):
        assert padding_removed(_program(Encoder()), SIGNATURE, DIMS, example) is None
    assert "padding kept" in caplog.text and "CaptureError: torch.export could not capture" in caplog.text
