"""Hugging Face models from a local directory: ``hf:DIR`` with a task.

The directory is what ``save_pretrained`` writes (``config.json``, ``model.safetensors``, and
optionally a tokenizer). ``transformers`` reads it with ``local_files_only=True`` and
``HF_HUB_OFFLINE=1`` set while it loads, so nothing ever touches the network. Only transformers'
own model classes run: a config that asks for remote code (``auto_map``) is refused, so rebuilding
the eager reference from a manifest runs no code from the directory. Weights must be safetensors
(never a pickle).

Inputs come from the model's ``forward`` signature, narrowed by the tokenizer's
``model_input_names`` when the directory has a tokenizer: ``input_ids`` (ids in ``[0, vocab)``),
``token_type_ids`` (ids in ``[0, type_vocab_size)``) and ``attention_mask`` (a 0/1 mask). The
sequence range runs up to the config's ``max_position_embeddings``; the output is named by the task.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.errors import UsageError, first_line
from tk.limits import extrapolated_bytes, module_bytes, require_within_budget
from tk.models.base import ModelSpec
from tk.spec import Dim, Signature, TensorSpec

PREFIX = "hf:"
# task -> (transformers Auto class (tk.registries.HF_TASKS lists the same names for the command line), output name, output dims after (batch,): "seq", "hidden", "labels", "vocab")
TASKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "feature-extraction": ("AutoModel", "last_hidden_state", ("seq", "hidden")),
    "sequence-classification": ("AutoModelForSequenceClassification", "logits", ("labels",)),
    "token-classification": ("AutoModelForTokenClassification", "logits", ("seq", "labels")),
    "masked-lm": ("AutoModelForMaskedLM", "logits", ("seq", "vocab")),
}
DEFAULT_TASK = "feature-extraction"
KNOWN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # in the order the graph takes them
BATCH = Dim("batch", 1, 8, 64)
SEQ_OPT = 128  # the sequence size exports and checks use by default (capped by the config)


def is_hf_name(name: str) -> bool:
    return name.startswith(PREFIX)


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return "hf: models need transformers: pip install 'tk[hf]'"
    return None


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE=1`` and no progress bars while transformers loads, then both as they were.

    ``local_files_only=True`` in every load is what keeps transformers off the network (huggingface_hub
    reads ``HF_HUB_OFFLINE`` once, at import); the variable is set for code that reads it later.
    """
    from transformers.utils import logging as hf_logging

    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" bars on every rebuild of the reference
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


class HFTaskModel(nn.Module):
    """A transformers model called with positional inputs, returning its task's one output tensor."""

    def __init__(self, model: nn.Module, input_names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.input_names = input_names

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.input_names, args, strict=True)), return_dict=True)
        return out[0]  # last_hidden_state or logits


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise UsageError(f"hf:{directory}: expected a directory written by save_pretrained, found no config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise UsageError(f"hf:{directory}: config.json is not valid JSON ({first_line(exc)})") from exc
    if not isinstance(config, dict):
        raise UsageError(f"hf:{directory}: config.json: expected a JSON object, found {type(config).__name__}")
    if "auto_map" in config:
        raise UsageError(
            f"hf:{directory}: the config asks for the model's own code (auto_map); tk runs only transformers' "
            "classes and never trust_remote_code"
        )
    return config


def _tokenizer_input_names(directory: Path) -> list[str] | None:
    """The tokenizer's ``model_input_names`` when the directory has a tokenizer, else None."""
    if not (directory / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # a damaged tokenizer: say which file, keep the model usable
        raise UsageError(
            f"hf:{directory}: cannot read the tokenizer ({type(exc).__name__}: {first_line(exc)})"
        ) from exc
    return list(tokenizer.model_input_names)


def estimated_bytes(directory: Path, task: str) -> int:
    """Bytes of the float32 parameters and buffers the directory's config describes, measured on
    the meta device (nothing allocated). A config with many layers is measured at 1 and 2 layers
    and extrapolated, so a config asking for 2,000 layers costs two small meta builds."""
    import transformers

    auto_cls = getattr(transformers, TASKS[task][0])
    try:
        config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)

        def meta_bytes(layers: int | None) -> int:
            cfg = config
            if layers is not None:
                cfg = copy.deepcopy(config)
                cfg.num_hidden_layers = layers
            with torch.device("meta"):
                return module_bytes(auto_cls.from_config(cfg, dtype=torch.float32))

        return extrapolated_bytes(meta_bytes, getattr(config, "num_hidden_layers", None))
    except Exception as exc:  # transformers raises many types for a config it cannot build
        raise UsageError(
            f"hf:{directory}: transformers cannot build the model its config.json describes as {task} "
            f"({type(exc).__name__}: {first_line(exc)})"
        ) from exc


def load_hf_module(directory: Path, task: str) -> tuple[nn.Module, Any]:
    """The transformers model for ``task`` at ``directory`` in float32 eval mode, and its config;
    refused before anything is allocated when it would exceed tk's memory budget."""
    import transformers

    auto_name = TASKS[task][0]
    auto_cls = getattr(transformers, auto_name)
    require_within_budget(estimated_bytes(directory, task), f"hf:{directory} (the model its config.json describes)")
    try:
        model = auto_cls.from_pretrained(
            str(directory),
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            dtype=torch.float32,
            attn_implementation="sdpa",
        )
    except Exception as exc:  # transformers and safetensors (SafetensorError) raise many types for a bad directory
        raise UsageError(
            f"hf:{directory}: transformers cannot load it as {task} ({auto_name}): {type(exc).__name__}: "
            f"{first_line(exc)}; expected safetensors weights saved with save_pretrained"
        ) from exc
    return model.eval(), model.config


def build_hf_model(name: str, task: str | None = None) -> ModelSpec:
    """``hf:DIR`` for ``task`` (default feature-extraction) as a ``ModelSpec`` (no training task)."""
    reason = unavailable_reason()
    if reason:
        raise UsageError(reason)
    task = task or DEFAULT_TASK
    if task not in TASKS:
        raise UsageError(f"--task: expected one of {', '.join(TASKS)}, got {task!r}")
    directory = Path(name[len(PREFIX) :]).expanduser()
    if not directory.is_dir():
        raise UsageError(f"{name}: expected a local directory written by save_pretrained, found none")
    directory = directory.resolve()
    config_json = _read_config(directory)
    with offline():
        tokenizer_names = _tokenizer_input_names(directory)
        model, config = load_hf_module(directory, task)
    accepted = inspect.signature(model.forward).parameters
    names = [n for n in KNOWN_INPUTS if n in accepted and (tokenizer_names is None or n in tokenizer_names)]
    if "input_ids" not in names:
        raise UsageError(f"{name}: expected a text model whose forward takes input_ids, found {list(accepted)[:6]}")
    vocab = int(config_json.get("vocab_size") or config.vocab_size)
    limit = _position_limit(model)
    max_pos = limit or int(getattr(config, "max_position_embeddings", 512) or 512)  # the default range's max
    inputs = []
    for n in names:
        if n == "input_ids":
            inputs.append(TensorSpec(n, "int64", ("batch", "seq"), kind="ids", low=0, high=vocab))
        elif n == "token_type_ids":
            types = int(getattr(config, "type_vocab_size", 2) or 2)
            inputs.append(TensorSpec(n, "int64", ("batch", "seq"), kind="ids", low=0, high=types))
        else:
            inputs.append(TensorSpec(n, "int64", ("batch", "seq"), kind="mask", low=0, high=2))
    sizes = {"seq": "seq", "hidden": int(config.hidden_size), "vocab": vocab, "labels": int(config.num_labels)}
    output_name, output_dims = TASKS[task][1], TASKS[task][2]
    outputs = [TensorSpec(output_name, "float32", ("batch", *(sizes[d] for d in output_dims)))]
    dims = {"batch": BATCH, "seq": Dim("seq", 1, min(SEQ_OPT, max_pos), max_pos)}
    module = HFTaskModel(model, names).eval()
    signature = Signature(inputs, outputs, dims)
    max_sizes = {"seq": limit} if limit else {}
    return ModelSpec(f"{PREFIX}{directory}", None, {"task": task}, module, signature, max_sizes=max_sizes)


def _position_limit(model: nn.Module) -> int | None:
    """The longest sequence a learned position table holds (``*.position_embeddings``), or None where the
    model has none (rotary or relative positions: the config's ``max_position_embeddings`` is no hard limit).
    RoBERTa-style tables start counting after their padding index, which takes ``padding_idx + 1`` rows."""
    for name, module in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, nn.Embedding):
            reserved = module.padding_idx + 1 if module.padding_idx is not None else 0
            return module.num_embeddings - reserved
    return None
