"""The fair peer harness (benchmarks.peers) and the model's floor (tk.measure.floor): feeds, products, block
order, verdicts. No timing is judged: only counts, shapes and the arithmetic on given numbers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from benchmarks.peers import Recipe, realistic_feeds, time_alone, time_both_ways, verdict
from tk.measure.floor import ModelFloor, Product, at_real_tokens, attention_precision, model_products


def test_realistic_feeds_pad_on_the_right_with_type_ids_zero():
    feeds = realistic_feeds(6, 20, 1000, seed=3)
    ids, mask = feeds["input_ids"], feeds["attention_mask"]
    assert ids.shape == mask.shape == feeds["token_type_ids"].shape == (6, 20)
    assert not feeds["token_type_ids"].any()
    lengths = mask.sum(axis=1)
    assert lengths[0] == 20 and lengths.min() >= 5 and len(set(lengths.tolist())) > 1
    for row, length in enumerate(lengths):
        assert (mask[row, :length] == 1).all() and (mask[row, length:] == 0).all()
        assert ids[row, 0] == 101 and ids[row, length - 1] == 102 and (ids[row, length:] == 0).all()
        assert (ids[row, 1 : length - 1] > 102).all()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_model_products_counts_linears_and_attention_at_their_shapes(attention):
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, attn_implementation=attention)  # fmt: skip
    model = BertModel(config).eval()
    ids = torch.randint(0, 100, (3, 10))
    products = model_products(lambda: model(input_ids=ids))
    linears = {(p.m, p.k, p.n): p.count for p in products if p.kind == "linear"}
    # per layer q, k, v, the attention output; the feed-forward's two; the pooler on the first token
    assert linears == {(30, 32, 32): 8, (30, 32, 64): 2, (30, 64, 32): 2, (3, 32, 32): 1}
    attention_products = {(p.batch, p.m, p.k, p.n): p.count for p in products if p.kind == "attention"}
    assert attention_products == {(12, 10, 8, 10): 2, (12, 10, 10, 8): 2}  # scores, then weights x values
    assert sum(p.flops for p in products) == 2 * (8 * 30 * 32 * 32 + 4 * 30 * 32 * 64 + 3 * 32 * 32
                                                  + 2 * 2 * 12 * 10 * 8 * 10)  # fmt: skip


def test_on_a_padded_batch_the_floor_counts_linears_at_real_tokens_and_attention_per_sequence():
    """Products recorded on 3 x 10 with 10, 4 and 4 real tokens: the linears over every position run on 18
    rows, the pooler's stays; each attention product splits into one per length, its heads x sequences batch."""
    recorded = [
        Product("linear", 1, 30, 32, 64, 8), Product("linear", 1, 3, 32, 32, 1),
        Product("attention", 12, 10, 8, 10, 2), Product("attention", 12, 10, 10, 8, 2),
        Product("attention", 12, 10, 10, 10, 2),  # head size = sequence length: which is which is unknown
    ]  # fmt: skip
    mask = torch.tensor([[1] * 10, [1] * 4 + [0] * 6, [1] * 4 + [0] * 6])
    got = {(p.kind, p.batch, p.m, p.k, p.n, p.count) for p in at_real_tokens(recorded, mask)}
    assert got == {
        ("linear", 1, 18, 32, 64, 8), ("linear", 1, 3, 32, 32, 1),
        ("attention", 4, 10, 8, 10, 2), ("attention", 8, 4, 8, 4, 2),  # scores: 4 heads x 1 and x 2 sequences
        ("attention", 4, 10, 10, 8, 2), ("attention", 8, 4, 4, 8, 2),  # weights x values
        ("attention", 12, 10, 10, 10, 2),
    }  # fmt: skip
    real = 2 * (8 * 18 * 32 * 64 + 3 * 32 * 32 + 2 * 2 * (4 * 10 * 8 * 10 + 8 * 4 * 8 * 4) + 2 * 12 * 1000)
    assert sum(p.flops for p in at_real_tokens(recorded, mask)) == real
    assert at_real_tokens(recorded, torch.ones(3, 10)) == recorded  # nothing padded


def test_the_floor_times_each_product_and_keeps_each_ones_time():
    products = [Product("linear", 1, 16, 32, 32, count=3), Product("attention", 4, 8, 8, 8, count=2)]
    floor = ModelFloor("fp32", products)
    assert floor.samples == [] and floor.product_samples == []  # no sample yet
    for _ in range(3):
        floor()
    assert len(floor.samples) == 3 and all(s > 0 for s in floor.samples)
    # each sample is the sum of its products' times, each times its count
    for total, each in zip(floor.samples, floor.product_samples, strict=True):
        assert total == pytest.approx(3 * each[0] + 2 * each[1]) and all(t > 0 for t in each)
    stored = floor.to_json()
    assert stored["flops"] == 2 * (3 * 16 * 32 * 32 + 2 * 4 * 8 * 8 * 8) and stored["seconds"]["n"] == 3
    assert attention_precision("int8") in ("bf16", "fp32") and attention_precision("bf16") == "bf16"


def _row(engine: str, ms: float, cosine: float | None, gap: float = 0.01, alone: float | None = None,
         reversed_ms: float | None = None) -> dict:  # fmt: skip
    return {"engine": engine, "ms": ms, "ms_in_order": ms, "ms_reversed": reversed_ms or ms, "ms_alone": alone or ms,
            "min_cosine": cosine, "valid": cosine is None or cosine >= 0.9999, "gap": gap}  # fmt: skip


def test_a_mixed_int8_picks_floor_prices_each_linear_in_its_own_precision():
    from benchmarks.peers import recipe_floor_ms
    from tk.measure.floor import LinearSplit, Product

    products = [Product("linear", 1, 8, 16, 32, 2), Product("attention", 2, 4, 8, 4, 1)]
    in_run = {"int8": [[1.0, 4.0], [1.0, 4.0], [1.0, 4.0]], "fp32": [[3.0, 9.0], [3.0, 9.0], [3.0, 9.0]]}
    lone = {"int8": [[2.0, 4.0]], "fp32": [[2.5, 9.0]]}
    assert recipe_floor_ms(products, "fp32", None, in_run, lone) == pytest.approx(1e3 * min(2 * 3 + 9, 2 * 2.5 + 9))
    assert recipe_floor_ms(products, "int8", None, in_run, lone) == pytest.approx(1e3 * (2 * 1 + 4))
    # one of the two 16 x 32 linears in int8, the other in float32, attention at int8's float precision
    half = LinearSplit({(16, 32): 1}, "fp32")
    assert recipe_floor_ms(products, "int8", half, in_run, lone) == pytest.approx(1e3 * min(1 + 3 + 4, 2 + 2.5 + 4))


def test_a_rival_below_the_bar_is_invalid_never_beaten():
    rows = [_row("pick", 10.0, 0.99995), _row("fast but wrong", 5.0, 0.99), _row("honest", 12.0, 0.99999),
            _row("eager", 30.0, None, gap=0.08)]  # fmt: skip
    got = verdict(rows, "pick", "eager")
    assert got["faster_valid_rival"] == "honest" and got["speedup"] == 1.2
    assert got["invalid_rivals"] == ["fast but wrong"] and got["speedup_vs_reference"] == 3.0
    assert got["pick_valid"] and not got["timings_agree"]  # eager's three medians are 8% apart


def test_the_speed_up_is_the_lower_of_the_blocks_and_alone():
    rows = [
        _row("pick", 10.0, 0.99995, alone=9.5),
        _row("rival", 12.0, 0.99999, alone=10.45),
        _row("eager", 30.0, None),
    ]
    got = verdict(rows, "pick", "eager")
    assert (got["speedup_in_blocks"], got["speedup_alone"], got["speedup"]) == (1.2, 1.1, 1.1)
    assert got["ratio_gaps"] == {"rival": 0.0909} and not got["ratios_agree"]  # 1.2 / 1.1 - 1


def test_ratios_agree_when_the_whole_run_drifts_but_not_when_one_engine_gains_from_its_turn():
    drifted = [  # everyone 8% slower alone: the timings disagree, the ratio is the same three ways
        _row("pick", 10.0, 0.99995, gap=0.08, alone=10.8), _row("rival", 12.0, 0.99999, gap=0.08, alone=12.96),
        _row("eager", 30.0, None),
    ]  # fmt: skip
    got = verdict(drifted, "pick", "eager")
    assert got["orders_agree"] and not got["timings_agree"] and got["ratios_agree"]
    assert got["ratio_gaps"] == {"rival": 0.0}
    favoured = [  # the rival runs 7% faster only when it follows the pick
        _row("pick", 10.0, 0.99995), _row("rival", 12.0, 0.99999, reversed_ms=11.2), _row("eager", 30.0, None),
    ]  # fmt: skip
    got = verdict(favoured, "pick", "eager")
    assert not got["ratios_agree"] and got["ratio_gaps"]["rival"] == pytest.approx(12.0 / 11.2 - 1, abs=1e-4)
    assert not got["orders_agree"]  # 12.0 in order against 11.2 reversed: 7% apart


def test_the_two_orders_alternate_round_by_round():
    ran: list[str] = []
    calls = {name: (lambda name=name: ran.append(name)) for name in "abc"}
    forward, backward = time_both_ways(calls, rounds=range(2), block=2, order=list("abc"))
    blocks = [ran[i] for i in range(0, len(ran), 3)]  # a block: one untimed call, then two timed
    assert ran == [name for name in blocks for _ in range(3)]
    # round 1 in order, then reversed from two places on; round 2 rotated by one: no call follows its own block
    assert "".join(blocks) == "abc" + "bac" + "bca" + "cba"
    assert all(a != b for a, b in itertools.pairwise(blocks))
    assert all(len(forward[n]) == len(backward[n]) == 4 for n in "abc")
    ran.clear()
    time_both_ways(calls, rounds=range(1, 2), block=2, order=list("abc"))  # a later half goes on rotating
    assert "".join(ran[i] for i in range(0, len(ran), 3)) == "bca" + "cba"


def test_an_engine_is_timed_alone_in_its_own_process(tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])  # fmt: skip
    model = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, x=np.ones((2, 3), dtype=np.float32), unused=np.zeros(1))
    times = time_alone(Recipe("relu", "onnxruntime", str(model)), feeds, calls=4, threads=1)
    assert len(times) == 4 and all(t > 0 for t in times)
