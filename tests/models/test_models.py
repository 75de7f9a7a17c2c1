"""Built-in models: shapes, float64 agreement, and masking."""

from __future__ import annotations

import copy

import pytest
import torch

from tk.errors import UsageError
from tk.models import build_model, entries

BATCH = 3


@pytest.mark.parametrize("name", sorted(entries()))
def test_output_shapes_match_the_signature(name):
    spec = build_model(name, size="tiny")
    spec.module.eval()
    sizes = {"batch": BATCH, "seq": 11}
    inputs = spec.example_inputs({d: sizes.get(d, dim.opt) for d, dim in spec.signature.dims.items()})
    with torch.no_grad():
        out = spec.module(*inputs)
    outputs = out if isinstance(out, tuple) else (out,)  # a decoder's step: logits and the new keys and values
    assert len(outputs) == len(spec.signature.outputs)
    for tensor, output in zip(outputs, spec.signature.outputs, strict=True):
        assert tuple(tensor.shape) == output.concrete_shape({**sizes, "batch": BATCH})
        assert tensor.dtype == torch.float32


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_transformer_float32_matches_float64(size):
    spec = build_model("transformer", size=size)
    model32 = spec.module.eval()
    model64 = copy.deepcopy(model32).double()
    ids, mask = spec.example_inputs({"batch": 4, "seq": 32})
    with torch.no_grad():
        out32 = model32(ids, mask)
        out64 = model64(ids, mask)
    err = (out32.double() - out64).abs().max().item()
    scale = out64.abs().max().item()
    assert err <= 1e-5 * max(scale, 1.0), f"float32 vs float64: max abs error {err:.3g} at scale {scale:.3g}"


def test_padded_batch_equals_samples_run_alone():
    spec = build_model("transformer", size="tiny")
    model = spec.module.eval()
    lengths = [5, 12, 1, 9]
    seq = max(lengths)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (len(lengths), seq), generator=gen)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        batched = model(ids * mask, mask)
        for i, length in enumerate(lengths):
            alone = model(ids[i : i + 1, :length], torch.ones(1, length, dtype=torch.long))
            torch.testing.assert_close(batched[i : i + 1], alone, rtol=1e-5, atol=1e-6)


def test_mask_changes_the_output_when_padding_differs():
    """The mask is used: the same ids with padding unmasked give another result."""
    spec = build_model("transformer", size="tiny")
    model = spec.module.eval()
    ids = torch.randint(1, 1000, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, torch.ones(1, 10, dtype=torch.long))
        masked = model(ids, torch.tensor([[1] * 5 + [0] * 5]))
    assert (full - masked).abs().max().item() > 1e-4


def test_transformer_sizes_follow_the_issue():
    small, base = entries()["transformer"].sizes["small"], entries()["transformer"].sizes["base"]
    assert (small.hidden, small.layers, small.heads, small.ffn, small.vocab_size) == (256, 4, 4, 1024, 8000)
    assert (base.hidden, base.layers, base.heads, base.ffn, base.vocab_size) == (768, 12, 12, 3072, 30522)
    assert small.max_seq_len == base.max_seq_len == 512


def test_attention_uses_one_fused_qkv_projection():
    model = build_model("transformer", size="tiny").module
    block = model.blocks[0]
    assert block.attn.qkv.out_features == 3 * block.attn.qkv.in_features


def test_random_inputs_are_valid():
    spec = build_model("transformer", size="tiny")
    ids, mask = spec.example_inputs({"batch": 16, "seq": 20}, seed=3)
    assert int(ids.min()) >= 0 and int(ids.max()) < 1000
    assert set(mask.unique().tolist()) <= {0, 1}
    assert bool((mask.sum(dim=1) >= 1).all())
    # padding on the right only: a row never goes from 0 back to 1
    assert bool((mask[:, 1:] <= mask[:, :-1]).all())


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("mlp", {"input_descriptions": ("x:float32[batch,4]",)}, "--input describes a user model's inputs"),
        ("mlp", {"task": "masked-lm"}, "--task applies to hf:DIR models, not to 'mlp'"),
        ("no_such_package.module:build", {"size": "tiny"}, "--size applies to built-in models"),
        ("hf:/nonexistent", {"size": "tiny"}, "--size and --input do not apply to 'hf:/nonexistent'"),
    ],
)
def test_build_model_refuses_arguments_that_do_not_apply(name, kwargs, message):
    """The library, not only the command line, refuses them (and before importing any user code)."""
    with pytest.raises(UsageError, match=message):
        build_model(name, **kwargs)


def test_a_model_is_built_from_its_seed_and_leaves_the_callers_generator_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = build_model("transformer", size="tiny"), build_model("transformer", size="tiny")
    c = build_model("transformer", size="tiny", seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = (m.module.state_dict() for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # the same weights in every process: exports reproduce
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize(
    "name, config",
    [
        ("transformer", {"vocab_size": 50, "max_seq_len": 16, "hidden": 8, "layers": 5, "heads": 2, "ffn": 16}),
        ("mlp", {"in_features": 3, "hidden": 7, "layers": 6, "num_classes": 2}),
        ("mlp", {"in_features": 3, "hidden": 7, "layers": 2, "num_classes": 2}),  # measured whole
    ],
)
def test_a_manifests_model_is_sized_exactly_from_builds_at_one_and_two_layers(name, config):
    from tk.limits import module_bytes
    from tk.runtime.eager import _builtin_bytes

    built = module_bytes(build_model(name, config=config).module)  # allocated for real
    assert _builtin_bytes("ART", {"name": name, "config": config}) == built
