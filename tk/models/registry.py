"""The built-in models by name, and ``build_model`` for them and for ``package.module:callable``.

Adding a model is one file defining its ``ENTRY`` plus one line in ``_entries``.
"""

from __future__ import annotations

from typing import Any

from tk.errors import UsageError
from tk.models.base import ModelEntry, ModelSpec


def _entries() -> dict[str, ModelEntry]:
    from tk.models import decoder, linear, mlp, resnet, transformer

    entries = [transformer.ENTRY, decoder.ENTRY, linear.ENTRY, mlp.ENTRY, resnet.ENTRY]
    return {e.name: e for e in entries}


ENTRIES: dict[str, ModelEntry] = {}


def entries() -> dict[str, ModelEntry]:
    """Every built-in model, by name."""
    if not ENTRIES:
        ENTRIES.update(_entries())
    return ENTRIES


DEFAULT_SEED = 0


def build_model(
    name: str,
    *,
    size: str | None = None,
    config: dict[str, Any] | None = None,
    input_descriptions: tuple[str, ...] = (),
    task: str | None = None,
    seed: int = DEFAULT_SEED,
    cache_len: int | None = None,
) -> ModelSpec:
    """A built-in model by registry name (``size``), a Hugging Face directory ``hf:DIR`` (``task``,
    or ``config["task"]``), or a user model given as ``package.module:callable``
    (``input_descriptions``); an argument that does not apply to the kind of model is refused.

    The model is built with torch's generator seeded with ``seed`` (the caller's generator state is
    kept): the same name and seed give the same initial weights in every process, so an untrained
    model exported twice is the same model (``tk train --seed`` seeds weights and data).

    ``cache_len``: a decoder's static KV cache slots (``tk export --max-cache-len``)."""
    import torch

    if cache_len is not None:
        size, config = None, _with_cache_len(name, size, config, cache_len)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _build(name, size, config, input_descriptions, task)


def _with_cache_len(name: str, size: str | None, config: dict[str, Any] | None, cache_len: int) -> dict[str, Any]:
    """The decoder's config (the built-in one's, of ``size`` or ``config``; an ``hf:DIR``'s reference) with
    ``max_cache_len`` set."""
    import dataclasses

    from tk.models.hf import is_hf_name

    if is_hf_name(name):
        return {**(config or {}), "max_cache_len": cache_len}
    entry = entries().get(name)
    if entry is None or "max_cache_len" not in {f.name for f in dataclasses.fields(entry.config_cls)}:
        raise UsageError(
            f"--max-cache-len applies to decoders (decoder, hf:DIR --task text-generation), not to {name!r}"
        )
    if config is None:
        size = size or "small"
        if size not in entry.sizes:
            raise UsageError(f"model {name!r}: expected a size in {', '.join(entry.sizes)}, got {size!r}")
        config = dataclasses.asdict(entry.sizes[size])
    return {**config, "max_cache_len": cache_len}


def _build(
    name: str, size: str | None, config: dict[str, Any] | None, input_descriptions: tuple[str, ...], task: str | None
) -> ModelSpec:
    from tk.models.hf import is_hf_name

    if task and not is_hf_name(name):
        raise UsageError(f"--task applies to hf:DIR models, not to {name!r}")
    if is_hf_name(name):
        if size or input_descriptions:
            raise UsageError(f"--size and --input do not apply to {name!r}: its config and tokenizer describe it")
        from tk.models.hf import build_hf_model

        recorded = config or {}  # a manifest's reference: the task, and the attention it was loaded with
        return build_hf_model(
            name,
            task or recorded.get("task"),
            attention=recorded.get("attn_implementation"),
            cache_len=recorded.get("max_cache_len"),
        )
    if ":" in name or name.endswith(".py"):  # a file without its callable gets build_user_model's hint
        if size:
            raise UsageError(f"--size applies to built-in models, not to {name!r}")
        from tk.models.user import build_user_model

        return build_user_model(name, input_descriptions)
    if input_descriptions:
        raise UsageError(f"--input describes a user model's inputs; {name!r} is a built-in model with its own")
    known = entries()
    if name not in known:
        raise UsageError(f"unknown model {name!r}: expected one of {', '.join(known)} or package.module:callable")
    return known[name].build(size, config)
