"""What each ``hf:DIR`` task exports: the transformers class that loads it, the module traced, its signature.

A task names a transformers Auto class (the first of its classes that maps the directory's config loads
it) and what the graph returns. The model's ``main_input_name`` says which inputs it takes, and the
config says their sizes and valid values:

- text (``input_ids``): ids in ``[0, vocab_size)``, an attention mask, ``token_type_ids`` where the
  config has a token type table (``type_vocab_size``); ``seq`` up to ``max_position_embeddings``.
- images (``pixel_values``): float32 ``(batch, num_channels, height, width)``, the size from the config's
  ``image_size`` (or its ``vision_config``'s), 224 where it has none; ``height`` and ``width`` are static
  dimensions (``--dim height=N`` sets another size where the model takes it).
- waveforms (``input_values``, wav2vec2): float32 ``(batch, samples)``, a dynamic ``samples`` from two
  feature frames (the feature encoder's receptive field) to 10 s at the config's 16 kHz.
- spectrograms (``input_features``, Whisper): float32 ``(batch, num_mel_bins, frames)``, the frames
  static at twice ``max_source_positions`` (Whisper's encoder refuses any other length).

Only text-generation generates (``tk.models.hf_generation``: one step with a static KV cache); every
other task runs with ``use_cache=False``: a graph that kept the cache would carry its empty
``past_key_values`` tensors and their concatenation.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tk.errors import UsageError, first_line
from tk.spec import Dim, Signature, TensorSpec, random_feeds

log = logging.getLogger("tk.models")

BATCH = Dim("batch", 1, 8, 64)
SEQ_OPT = 128  # the sequence size exports and checks use by default (capped by the config)
DECODER_SEQ_OPT = 16  # the decoder step's typical number of tokens generated so far
DEFAULT_IMAGE_SIZE = 224  # where the config names none (ResNet, RegNet): ImageNet's size
SAMPLING_RATE = 16000  # wav2vec2's feature extractors sample at 16 kHz
MAX_SECONDS = 10  # the longest waveform of the default range
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # in the order the graph takes them


@dataclass(frozen=True)
class Task:
    """One ``--task``: the Auto classes that load it, its output's name, and what the output's axes hold."""

    auto_classes: tuple[str, ...]  # tried in order: the first that maps the config's type loads the directory
    output: str
    axes: tuple[str, ...] = ()  # a text output's axes after batch: "seq", "hidden", "labels", "vocab"
    media: str | None = None  # "image": the task needs a model of pixel_values
    part: str | None = None  # "encoder" or "decoder" of an encoder-decoder model


TASKS: dict[str, Task] = {
    "feature-extraction": Task(("AutoModel",), "last_hidden_state", ("seq", "hidden")),
    "sequence-classification": Task(("AutoModelForSequenceClassification",), "logits", ("labels",)),
    "token-classification": Task(("AutoModelForTokenClassification",), "logits", ("seq", "labels")),
    "masked-lm": Task(("AutoModelForMaskedLM",), "logits", ("seq", "vocab")),
    "image-classification": Task(("AutoModelForImageClassification",), "logits", media="image"),
    "image-feature-extraction": Task(("AutoModel",), "last_hidden_state", media="image"),
    "causal-lm": Task(("AutoModelForCausalLM",), "logits", ("seq", "vocab")),
    "text2text-encoder": Task(("AutoModel",), "last_hidden_state", ("seq", "hidden"), part="encoder"),
    "text2text-decoder": Task(("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq"), "logits", part="decoder"),
    "text-generation": Task(("AutoModelForCausalLM",), "logits", part="generation"),
}
DEFAULT_TASK = "feature-extraction"


@dataclass
class TaskGraph:
    """What ``build_hf_model`` makes a ``ModelSpec`` of: the module traced and its signature."""

    module: nn.Module
    signature: Signature
    max_sizes: dict[str, int] = field(default_factory=dict)  # dimension -> the most a position table holds
    generation: dict[str, Any] | None = None  # text-generation: the cache layout and special tokens


class HFTaskModel(nn.Module):
    """A transformers model called with positional inputs, returning its task's one output tensor."""

    def __init__(self, model: nn.Module, input_names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.input_names = input_names
        takes = inspect.signature(model.forward).parameters
        self.fixed = {"use_cache": False} if "use_cache" in takes else {}  # nothing here generates

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.input_names, args, strict=True)), **self.fixed)
        return out[0]  # last_hidden_state or logits (the loss and the cache are None)


class DecoderStepModel(HFTaskModel):
    """One step of an encoder-decoder's decoder: the logits of every decoder position, given the encoder's
    output (``encoder_hidden_states``) in place of its inputs, so the encoder is not run again."""

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        from transformers.modeling_outputs import BaseModelOutput

        feeds = dict(zip(self.input_names, args, strict=True))
        encoded = BaseModelOutput(last_hidden_state=feeds.pop("encoder_hidden_states"))
        return self.model(**feeds, encoder_outputs=encoded, **self.fixed).logits


def task_graph(
    task: str,
    model: nn.Module,
    config: Any,
    tokenizer_names: list[str] | None,
    where: str,
    cache_len: int | None = None,
) -> TaskGraph:
    """The graph of ``task`` for the loaded ``model`` (``where``: ``hf:DIR``, for messages); ``cache_len``: the
    static KV cache's slots of text-generation."""
    spec = TASKS[task]
    main = getattr(model, "main_input_name", "input_ids")
    if cache_len is not None and spec.part != "generation":
        raise UsageError(f"--max-cache-len applies to --task text-generation, not to --task {task}")
    if spec.part == "generation":
        from tk.models.hf_generation import generation_graph

        module, signature, generation = generation_graph(model, config, where, cache_len)
        return TaskGraph(module, signature, generation=generation)
    if spec.part == "decoder":
        return _decoder_step(model, config, where)
    if spec.part == "encoder" or (task == DEFAULT_TASK and _is_encoder_decoder(config) and main == "input_features"):
        if not _is_encoder_decoder(config) or not hasattr(model, "get_encoder"):
            raise UsageError(
                f"{where}: --task {task} exports an encoder-decoder model's encoder (T5, BART, Whisper); this "
                f"{config.model_type} model has none: use --task feature-extraction"
            )
        model = model.get_encoder()
    if spec.media == "image" and main != "pixel_values":
        raise UsageError(f"{where}: --task {task} needs an image model (pixel_values); this one takes {main}")
    if main == "pixel_values":
        return _image_graph(task, model, config, where)
    if main == "input_values":
        return _waveform_graph(task, model, config)
    if main == "input_features":
        return _spectrogram_graph(task, model, config, where)
    if main != "input_ids":
        raise UsageError(f"{where}: expected a model of text, images or audio; this one takes {main}")
    graph = _text_graph(task, model, config, tokenizer_names, where)
    if task == DEFAULT_TASK and _is_encoder_decoder(config):
        _require_runs_alone(graph, where)
    return graph


def _is_encoder_decoder(config: Any) -> bool:
    return bool(getattr(config, "is_encoder_decoder", False))


def _text_graph(task: str, model: nn.Module, config: Any, tokenizer_names: list[str] | None, where: str) -> TaskGraph:
    accepted = inspect.signature(model.forward).parameters
    wanted = TEXT_INPUTS[:2] if task == "causal-lm" else TEXT_INPUTS
    names = [n for n in wanted if n in accepted and (tokenizer_names is None or n in tokenizer_names)]
    if not getattr(config, "type_vocab_size", 0) and "token_type_ids" in names:
        names.remove("token_type_ids")  # no token type table (GPT-2, DeBERTa-v2): the model ignores them
    if "input_ids" not in names:
        raise UsageError(f"{where}: expected a text model whose forward takes input_ids, found {list(accepted)[:6]}")
    vocab = int(config.vocab_size)
    inputs = [_text_input(n, vocab, config, ("batch", "seq")) for n in names]
    sizes = {"seq": "seq", "hidden": _hidden(config), "vocab": vocab, "labels": int(config.num_labels)}
    output = TensorSpec(TASKS[task].output, "float32", ("batch", *(sizes[a] for a in TASKS[task].axes)))
    limit = position_limit(model)
    dims = {"batch": BATCH, "seq": _sequence("seq", limit or _max_positions(config), SEQ_OPT)}
    return TaskGraph(HFTaskModel(model, names), Signature(inputs, [output], dims), {"seq": limit} if limit else {})


def _text_input(name: str, vocab: int, config: Any, shape: tuple[str, ...]) -> TensorSpec:
    if name in ("input_ids", "decoder_input_ids"):
        return TensorSpec(name, "int64", shape, kind="ids", low=0, high=vocab)
    if name == "token_type_ids":
        return TensorSpec(name, "int64", shape, kind="ids", low=0, high=int(config.type_vocab_size))
    return TensorSpec(name, "int64", shape, kind="mask", low=0, high=2)


def _hidden(config: Any) -> int:
    return int(getattr(config, "d_model", None) or config.hidden_size)


def _max_positions(config: Any) -> int:
    return int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 512)


def _sequence(name: str, longest: int, typical: int) -> Dim:
    return Dim(name, 1, max(2, min(typical, longest)), max(2, longest))


def _require_runs_alone(graph: TaskGraph, where: str) -> None:
    """An encoder-decoder model whose decoder has no input of its own (T5: BART makes its decoder's
    from ``input_ids``) fails here in a forward of one short sequence, not deep inside the capture."""
    feeds = random_feeds(graph.signature.inputs, {"batch": 1, "seq": min(8, graph.signature.dims["seq"].max)})
    try:
        with torch.no_grad():
            graph.module(*(torch.from_numpy(feeds[s.name]) for s in graph.signature.inputs))
    except Exception as exc:  # transformers raises ValueError, others any type
        raise UsageError(
            f"{where}: this encoder-decoder model cannot run from input_ids alone ({first_line(exc)}): export its "
            "encoder with --task text2text-encoder and its decoder step with --task text2text-decoder"
        ) from exc


def _image_graph(task: str, model: nn.Module, config: Any, where: str) -> TaskGraph:
    height, width = image_size(config, where)
    channels = int(getattr(config, "num_channels", None) or getattr(_vision(config), "num_channels", 3))
    pixels = TensorSpec("pixel_values", "float32", ("batch", channels, "height", "width"))
    dims = {"batch": BATCH, "height": Dim("height", height, height, height), "width": Dim("width", width, width, width)}
    module = HFTaskModel(model, ["pixel_values"])
    if task == "image-classification":
        output = TensorSpec("logits", "float32", ("batch", int(config.num_labels)))
    else:  # the features' shape follows the model: measured on one image
        with torch.no_grad():
            shape = module(torch.zeros(1, channels, height, width)).shape
        output = TensorSpec(TASKS[task].output, "float32", ("batch", *_feature_axes(tuple(shape[1:]))))
    return TaskGraph(module, Signature([pixels], [output], dims))


def _feature_axes(shape: tuple[int, ...]) -> tuple[int | str, ...]:
    """Image features' axes after batch: the axes that follow the image's size are named (a ViT's tokens, a
    CNN's feature map), so an export at another ``--dim height`` keeps a true signature."""
    if len(shape) == 2:
        return ("patches", shape[1])
    if len(shape) == 3:
        return (shape[0], "feature_height", "feature_width")
    return shape


def _vision(config: Any) -> Any:
    return getattr(config, "vision_config", None) or config


def image_size(config: Any, where: str) -> tuple[int, int]:
    """(height, width) from the config's ``image_size`` (an int or a pair), or its vision sub-config's;
    224 where neither names one (convolutional models take other sizes: ``--dim height=N``)."""
    size = getattr(config, "image_size", None) or getattr(_vision(config), "image_size", None)
    if size is None:
        log.info("%s: the config names no image_size: %d x %d images", where, DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)
        return DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE
    if isinstance(size, int):
        return size, size
    return int(size[0]), int(size[1])


def _waveform_graph(task: str, model: nn.Module, config: Any) -> TaskGraph:
    if task != DEFAULT_TASK:
        raise UsageError(f"--task {task}: an audio waveform model exports --task feature-extraction")
    shortest = _samples_for_frames(config, 2)
    samples = Dim("samples", shortest, max(shortest, SAMPLING_RATE), max(shortest, MAX_SECONDS * SAMPLING_RATE))
    wave = TensorSpec("input_values", "float32", ("batch", "samples"))
    output = TensorSpec("last_hidden_state", "float32", ("batch", "frames", _hidden(config)))
    return TaskGraph(
        HFTaskModel(model, ["input_values"]), Signature([wave], [output], {"batch": BATCH, "samples": samples})
    )


def _samples_for_frames(config: Any, frames: int) -> int:
    """The fewest samples the feature encoder's convolutions turn into ``frames`` frames."""
    samples = frames
    for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride, strict=True))):
        samples = (samples - 1) * stride + kernel
    return samples


def _spectrogram_graph(task: str, model: nn.Module, config: Any, where: str) -> TaskGraph:
    if task not in (DEFAULT_TASK, "text2text-encoder"):
        raise UsageError(f"--task {task}: a spectrogram model (input_features) exports --task text2text-encoder")
    positions = getattr(config, "max_source_positions", None)
    if positions is None:
        raise UsageError(f"{where}: expected a Whisper-like config with max_source_positions, found none")
    mel = TensorSpec("input_features", "float32", ("batch", int(config.num_mel_bins), 2 * int(positions)))
    output = TensorSpec("last_hidden_state", "float32", ("batch", int(positions), _hidden(config)))
    return TaskGraph(HFTaskModel(model, ["input_features"]), Signature([mel], [output], {"batch": BATCH}))


def _decoder_step(model: nn.Module, config: Any, where: str) -> TaskGraph:
    """decoder_input_ids (batch, decoder_seq) and the encoder's output -> logits (batch, decoder_seq, vocab)."""
    if not _is_encoder_decoder(config):
        raise UsageError(
            f"{where}: --task text2text-decoder needs an encoder-decoder model; this {config.model_type} has no encoder"
        )
    vocab, hidden = int(config.vocab_size), _hidden(config)
    longest = getattr(config, "max_target_positions", None) or _max_positions(config)
    dims = {"batch": BATCH, "decoder_seq": _sequence("decoder_seq", int(longest), DECODER_SEQ_OPT)}
    inputs = [_text_input("decoder_input_ids", vocab, config, ("batch", "decoder_seq"))]
    if model.main_input_name == "input_features":  # Whisper: the encoder's output has a fixed length, no mask
        inputs.append(
            TensorSpec("encoder_hidden_states", "float32", ("batch", int(config.max_source_positions), hidden))
        )
    else:
        dims["seq"] = _sequence("seq", _max_positions(config), SEQ_OPT)
        inputs.append(TensorSpec("encoder_hidden_states", "float32", ("batch", "seq", hidden)))
        inputs.append(_text_input("attention_mask", vocab, config, ("batch", "seq")))
    output = TensorSpec("logits", "float32", ("batch", "decoder_seq", vocab))
    module = DecoderStepModel(model, [s.name for s in inputs])
    return TaskGraph(module, Signature(inputs, [output], dims))


def position_limit(model: nn.Module) -> int | None:
    """The longest sequence a learned position table holds (``*.position_embeddings``), or None where the
    model has none (rotary or relative positions: the config's ``max_position_embeddings`` is no hard limit).
    RoBERTa-style tables start counting after their padding index, which takes ``padding_idx + 1`` rows."""
    for name, module in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, nn.Embedding):
            reserved = module.padding_idx + 1 if module.padding_idx is not None else 0
            return module.num_embeddings - reserved
    return None
