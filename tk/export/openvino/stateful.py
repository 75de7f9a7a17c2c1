"""A decoder's OpenVINO IR in OpenVINO's stateful form: the KV cache kept inside the infer request.

The step is captured in its growing-cache form (``tk.models.appended_step``), converted, and then given
what optimum-intel gives its models (``optimum.exporters.openvino.stateful``), with which OpenVINO's CPU
plugin fuses each layer's cache and attention into ``ScaledDotProductAttentionWithKVCache``: a ``beam_idx``
input that reorders the cache's rows (a ``Gather`` the fusion expects; tk feeds ``0..batch-1``), each cache
input and output made a variable by ``make_stateful``, and each variable's initial value an empty cache
of the batch's rows. Without the gather the plugin keeps a plain concatenation and attention (measured on
GPT-2 small in bf16: 14.0 ms a decode step with it, 16.2 without; tk's static cache took 16.9).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tk.errors import CaptureError, UsageError, first_line
from tk.export.context import ExportContext
from tk.export.openvino.convert import converted
from tk.formats.openvino import STATE_INPUTS, STATE_OUTPUTS
from tk.spec import Dim

EXAMPLE_PAST = 3  # cached slots of the capture's example (torch.export specializes sizes 0 and 1)
EXAMPLE_SEQ = 2


def stateful_decoder_ir(ctx: ExportContext) -> Any:
    """The stateful ``openvino.Model`` of the decoder ``ctx`` exports (its float32 module)."""
    import openvino as ov
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    from tk.models.appended_step import appended_step, state_names

    step = appended_step(ctx.spec.module)
    if step is None:
        raise UsageError(
            f"{ctx.spec.name}: tk writes OpenVINO decoders in stateful form for its own decoder and hf: models "
            "only; export this one --format onnx"
        )
    cache = ctx.spec.generation["cache"]
    layers, heads, head_dim = int(cache["layers"]), int(cache["heads"]), int(cache["head_dim"])
    past_names, present_names = state_names(layers)
    program = _captured(step, ctx.dims["batch"], int(cache["slots"]), (heads, head_dim), len(past_names))
    model = converted(program, "the decoder's stateful step")
    for port, name in zip(model.inputs, [*STATE_INPUTS[:3], *past_names], strict=True):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)
    for port, name in zip(model.outputs, [*STATE_OUTPUTS, *present_names], strict=True):
        port.get_tensor().set_names({name})

    beam = opset13.parameter(name=STATE_INPUTS[3], dtype=ov.Type.i32, shape=ov.PartialShape([-1]))
    beam.output(0).get_tensor().add_names({STATE_INPUTS[3]})
    model.add_parameters([beam])
    for name in past_names:
        port = model.input(name)
        readers = port.get_target_inputs()
        reordered = opset13.gather(port, beam, opset13.constant(0))
        for reader in readers:
            reader.replace_source_output(reordered.output(0))
    model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(model, dict(zip(past_names, present_names, strict=True)))

    rows = opset13.gather(
        opset13.shape_of(model.input(STATE_INPUTS[0]), output_type="i64"), opset13.constant([0]), opset13.constant(0)
    )
    empty = opset13.concat([rows, opset13.constant(np.array([heads, 0, head_dim], dtype=np.int64))], axis=0)
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            op.set_arguments([opset13.broadcast(opset13.constant(0.0, dtype=op.get_output_element_type(0)), empty)])
    model.validate_nodes_and_infer_types()
    return model


def _captured(step: torch.nn.Module, batch: Dim, slots: int, head: tuple[int, int], caches: int) -> Any:
    """``step`` captured by torch.export with the batch, the new tokens and the cached slots dynamic."""
    from torch.export import Dim as ExportDim

    rows = 2  # torch.export specializes a batch of 1
    batch_dim = ExportDim("batch", min=batch.min, max=max(batch.max, 2))
    seq_dim = ExportDim("seq", min=1, max=max(slots, EXAMPLE_SEQ))
    past_dim = ExportDim("past", min=0, max=max(slots - 1, EXAMPLE_PAST))
    total = EXAMPLE_PAST + EXAMPLE_SEQ
    example = (
        torch.zeros(rows, EXAMPLE_SEQ, dtype=torch.int64),
        torch.arange(EXAMPLE_PAST, total).repeat(rows, 1),
        torch.ones(rows, total, dtype=torch.int64),
        *(torch.zeros(rows, head[0], EXAMPLE_PAST, head[1]) for _ in range(caches)),
    )
    shapes = (
        {0: batch_dim, 1: seq_dim},
        {0: batch_dim, 1: seq_dim},
        {0: batch_dim, 1: ExportDim.AUTO},
        tuple({0: batch_dim, 2: past_dim} for _ in range(caches)),
    )
    step.eval()
    try:
        with torch.no_grad():
            return torch.export.export(step, example, dynamic_shapes=shapes, strict=False)
    except Exception as exc:  # torch.export raises many types; each is a capture failure of this model
        raise CaptureError(
            f"torch.export could not capture the decoder's stateful step for OpenVINO ({first_line(exc)}); "
            "export --format onnx instead"
        ) from exc
