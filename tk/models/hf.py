"""Hugging Face models from a local directory: ``hf:DIR`` with a task.

The directory is what ``save_pretrained`` writes (``config.json``, ``model.safetensors``, and
optionally a tokenizer). ``transformers`` reads it with ``local_files_only=True`` and
``HF_HUB_OFFLINE=1`` set while it loads, so nothing ever touches the network. Only transformers'
own model classes run: a config that asks for remote code (``auto_map``) is refused, so rebuilding
the eager reference from a manifest runs no code from the directory. Weights must be safetensors
(never a pickle).

The task (``tk.models.hf_tasks``) picks the transformers class and what the graph returns; the
model's main input and its config say the inputs (text, images, audio) and their ranges. The model
runs with ``use_cache=False``: nothing here generates, and a graph that kept the cache carries its
empty key/value tensors (OpenVINO's converter failed on GPT-2's). Attention runs through PyTorch's
``scaled_dot_product_attention`` where transformers has it for the model, else through the model's
own ("eager") attention, which the manifest records so that the reference rebuilds the same way.
transformers' ``Conv1D`` (GPT-2 and its kin), a linear layer whose weight is stored transposed and run as
``addmm``, is loaded as the ``nn.Linear`` it is, so that everything that finds a model's linears (the int8
writers' quantizers, the floor, the share of peak) finds it.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.errors import UsageError, first_line
from tk.limits import extrapolated_bytes, module_bytes, require_within_budget
from tk.models.base import ModelSpec
from tk.models.hf_tasks import DEFAULT_TASK, TASKS, task_graph

log = logging.getLogger("tk.models")

PREFIX = "hf:"
ATTENTION = (None, "eager", "sdpa")  # the attention implementations tk loads (None: SDPA where the model has it)


def is_hf_name(name: str) -> bool:
    return name.startswith(PREFIX)


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return "hf: models need transformers: pip install 'tk[hf]'"
    return None


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE=1``, no progress bars and only transformers' errors while it loads, then all three
    as they were (``load_hf_module`` says what matters of its loading report: weights it did not find).

    ``local_files_only=True`` in every load is what keeps transformers off the network (huggingface_hub
    reads ``HF_HUB_OFFLINE`` once, at import); the variable is set for code that reads it later.
    """
    from transformers.utils import logging as hf_logging

    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" bars on every rebuild of the reference
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a table of every unused weight (a head the task does not load)
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


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


def _auto_class(config: Any, task: str, where: str) -> Any:
    """The first of the task's transformers Auto classes that maps this config's type."""
    import transformers

    names = TASKS[task].auto_classes
    for name in names:
        auto_cls = getattr(transformers, name)
        if type(config) in auto_cls._model_mapping:
            return auto_cls
    raise UsageError(
        f"{where}: --task {task}: transformers has no {' or '.join(names)} class for a {config.model_type!r} "
        "model; choose the task its head was saved for"
    )


def _config(directory: Path, task: str) -> Any:
    """The directory's transformers config with the KV cache off (in every sub-config that has one)."""
    import transformers

    where = f"hf:{directory}"
    try:
        config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many types for a config it cannot read
        raise UsageError(
            f"{where}: transformers cannot read its config.json as {task} ({type(exc).__name__}: {first_line(exc)})"
        ) from exc
    parts = [config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", {}))]
    for part in parts:
        if part is not None and hasattr(part, "use_cache"):
            part.use_cache = False
    return config


def estimated_bytes(directory: Path, task: str) -> int:
    """Bytes of the float32 parameters and buffers the directory's config describes, measured on
    the meta device (nothing allocated). A config with many layers is measured at 1 and 2 layers
    and extrapolated, so a config asking for 2,000 layers costs two small meta builds."""
    config = _config(directory, task)
    auto_cls = _auto_class(config, task, f"hf:{directory}")
    try:

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


def _supports_sdpa(auto_cls: Any, config: Any) -> bool:
    """Whether the class ``auto_cls`` loads for ``config`` has SDPA attention (transformers maps some configs to
    several classes, DeiT's to a tuple: the one matching the config's architectures is the one loaded)."""
    from transformers.models.auto.auto_factory import _get_model_class

    return bool(getattr(_get_model_class(config, auto_cls._model_mapping), "_supports_sdpa", False))


def load_hf_module(directory: Path, task: str, attention: str | None = None) -> tuple[nn.Module, Any]:
    """The transformers model for ``task`` at ``directory`` in float32 eval mode, and its config;
    refused before anything is allocated when it would exceed tk's memory budget. ``attention``: the
    attention implementation to load (``"eager"``); default: SDPA where transformers has it for the
    model, else eager."""
    require_within_budget(estimated_bytes(directory, task), f"hf:{directory} (the model its config.json describes)")
    config = _config(directory, task)
    auto_cls = _auto_class(config, task, f"hf:{directory}")
    if attention is None:  # named always, so that no config.json can choose an implementation fetched from the Hub
        attention = "sdpa" if _supports_sdpa(auto_cls, config) else "eager"
    try:
        model, loading = auto_cls.from_pretrained(
            str(directory),
            config=config,
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            dtype=torch.float32,
            attn_implementation=attention,
            output_loading_info=True,
        )
    except Exception as exc:  # transformers and safetensors (SafetensorError) raise many types for a bad directory
        raise UsageError(
            f"hf:{directory}: transformers cannot load it as {task} ({auto_cls.__name__}): {type(exc).__name__}: "
            f"{first_line(exc)}; expected safetensors weights saved with save_pretrained"
        ) from exc
    missing = sorted(loading.get("missing_keys") or ())
    if missing:  # initialized at random: a head the directory was not saved with
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        log.warning(
            "hf:%s: no weights in the directory for %s of %s: they are random (saved for another task?)",
            directory,
            shown,
            type(model).__name__,
        )
    return _conv1d_as_linear(model).eval(), model.config


def _conv1d_as_linear(model: nn.Module) -> nn.Module:
    """``model`` with each transformers ``Conv1D`` replaced by the ``nn.Linear`` computing the same (its
    weight transposed): PT2E's x86 quantizer annotates ``aten.linear`` only, so GPT-2 small's 48 products stayed
    float32 in an int8 package, and its linears were missing from the floor and the share of peak."""
    from transformers.pytorch_utils import Conv1D

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                linear = nn.Linear(child.nx, child.nf, dtype=child.weight.dtype, device=child.weight.device)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
    return model


def build_hf_model(
    name: str, task: str | None = None, *, attention: str | None = None, cache_len: int | None = None
) -> ModelSpec:
    """``hf:DIR`` for ``task`` (default feature-extraction) as a ``ModelSpec`` (no training task);
    ``attention``: the attention implementation a manifest recorded (default: SDPA where it exists);
    ``cache_len``: text-generation's static KV cache slots (default: the config's positions, at most 1024)."""
    reason = unavailable_reason()
    if reason:
        raise UsageError(reason)
    task = task or DEFAULT_TASK
    if task not in TASKS:
        raise UsageError(f"--task: expected one of {', '.join(TASKS)}, got {task!r}")
    if attention not in ATTENTION:  # a manifest's value: never a kernel fetched from the Hub
        raise UsageError(f"{name}: expected an attention implementation of eager or sdpa, found {attention!r}")
    directory = Path(name[len(PREFIX) :]).expanduser()
    if not directory.is_dir():
        raise UsageError(f"{name}: expected a local directory written by save_pretrained, found none")
    directory = directory.resolve()
    where = f"{PREFIX}{directory}"
    _read_config(directory)
    with offline():
        tokenizer_names = _tokenizer_input_names(directory)
        model, config = load_hf_module(directory, task, attention)
    graph = task_graph(task, model, config, tokenizer_names, where, cache_len)
    reference: dict[str, Any] = {"task": task}
    if cache_len is not None:
        reference["max_cache_len"] = cache_len
    if attention is None and _fell_back_to_eager(model):
        log.info(
            "%s: transformers has no SDPA attention for %s: loaded with its eager attention",
            where,
            type(model).__name__,
        )
        attention = "eager"
    if attention is not None:
        reference["attn_implementation"] = attention  # the reference rebuilds with the same attention
    spec = ModelSpec(where, None, reference, graph.module.eval(), graph.signature, max_sizes=graph.max_sizes)
    spec.generation = graph.generation
    if graph.generation:
        from tk.models.hf_generation import STEP_TOLERANCES

        spec.tolerances = dict(STEP_TOLERANCES)
    return spec


def _fell_back_to_eager(model: nn.Module) -> bool:
    """Whether transformers loaded the model's eager attention because it has no SDPA one (a model
    without attention layers, such as a CNN, has nothing to fall back from)."""
    if getattr(model.config, "_attn_implementation", None) != "eager":
        return False
    return any("attention" in type(m).__name__.lower() for m in model.modules())
