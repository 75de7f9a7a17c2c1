"""The architectures of the coverage suite, as a user would bring them.

torchvision's classifiers are user models (``tests.model_coverage.catalog:NAME``, each a ``tk.models.UserModel``
taking ``images``), built with ``weights=None`` at 64x64 (the tiny ViT at 32x32). Hugging Face models are
tiny random configs (2 layers, hidden 32) saved with ``save_pretrained`` and exported through
``hf:DIR --task TASK``; an encoder-decoder directory gives two rows, its encoder and its decoder step.

Random weights need one fix to say anything: with its batch norms' default running statistics (mean 0,
variance 1) a deep CNN's activations shrink layer after layer (MobileNet's logits about 1e-10, EfficientNet's
1e-14), and torchvision's ViT starts with a zero head (logits exactly 0): every artifact would then "pass"
against a reference with no signal. So the batch norms hold the statistics of the inputs the model is run
on, as a trained model's do, and a zero-initialized weight is drawn at random.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.models.user import UserModel

FORMATS = ("torch", "onnx", "openvino")  # every CPU format; aoti (AOTInductor) only where Arch.aoti
IMAGE_SIZE = 32  # torchvision's CNNs: small (the float64 reference of the check is slow), each still runs
VOCAB = 100
CATALOG = "tests.model_coverage.catalog"


@dataclass(frozen=True)
class Arch:
    """One row of the table: a model as a user would export it."""

    name: str  # the row's name
    family: str  # vision | text | audio | seq2seq | causal-lm
    source: str  # "torchvision" (a builder in this module) or "hf" (a directory saved from HF_MODELS)
    builder: str  # torchvision: a callable of this module; hf: a key of HF_MODELS; else a module:callable
    task: str | None = None  # hf: the --task (tk.registries.HF_TASKS)
    aoti: bool = False  # AOTInductor too (a 20-60 s compile on two cores): the test is marked slow
    known: dict[str, str] = field(default_factory=dict)  # format -> a failure of tk reported, not yet fixed

    @property
    def formats(self) -> tuple[str, ...]:
        return (*FORMATS, "aoti") if self.aoti else FORMATS

    def model_name(self, hf_dirs: dict[str, Path]) -> str:
        """The name ``tk.models.build_model`` takes."""
        if self.source == "hf":
            return f"hf:{hf_dirs[self.builder]}"
        return self.builder if ":" in self.builder else f"{CATALOG}:{self.builder}"


def _with_signal(module: nn.Module, images: torch.Tensor) -> nn.Module:
    """``module`` in eval mode with batch norms holding the statistics of ``images`` and no all-zero weight."""
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() > 1 and not param.any():
                nn.init.normal_(param, std=0.02)
        norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None  # a cumulative average over the batches below
        if norms:
            module.train()
            for batch in images.split(8):
                module(batch)
    return module.eval()


def _classifier(
    name: str, make: Callable[[], nn.Module] | None = None, size: int = IMAGE_SIZE
) -> Callable[[], UserModel]:
    def build() -> UserModel:
        import torchvision

        module = make() if make else getattr(torchvision.models, name)(weights=None)
        module = _with_signal(module, torch.randn(16, 3, size, size))
        return UserModel(module, {"images": torch.randn(2, 3, size, size)}, output_names=["logits"])

    build.__name__ = name
    return build


def _tiny_vit() -> nn.Module:
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)


resnet50 = _classifier("resnet50")
mobilenet_v3_small = _classifier("mobilenet_v3_small")
efficientnet_b0 = _classifier("efficientnet_b0")
convnext_tiny = _classifier("convnext_tiny")
regnet_y_400mf = _classifier("regnet_y_400mf")
densenet121 = _classifier("densenet121")
squeezenet1_0 = _classifier("squeezenet1_0")
shufflenet_v2_x0_5 = _classifier("shufflenet_v2_x0_5")
mnasnet0_5 = _classifier("mnasnet0_5")
vit_tiny = _classifier("vit_tiny", _tiny_vit, size=32)

TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
TEXT |= {"intermediate_size": 64, "max_position_embeddings": 64}
SPECIAL = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}  # ids inside the tiny vocabulary
DECODER = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
DECODER |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, **SPECIAL}
SWIN = {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4}
VISION = {"image_size": 32, "patch_size": 8, "num_channels": 3} | {k: v for k, v in TEXT.items() if k != "vocab_size"}


def _bart(tf: Any) -> nn.Module:
    config = tf.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        decoder_start_token_id=2, forced_eos_token_id=2, **SPECIAL,
    )  # fmt: skip
    return tf.BartForConditionalGeneration(config)


def _whisper(tf: Any) -> nn.Module:
    config = tf.WhisperConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
        max_source_positions=16, max_target_positions=32, decoder_start_token_id=0, begin_suppress_tokens=None,
        suppress_tokens=None, **SPECIAL,
    )  # fmt: skip
    return tf.WhisperForConditionalGeneration(config)


def _wav2vec2(tf: Any) -> nn.Module:
    config = tf.Wav2Vec2Config(
        **{**TEXT, "vocab_size": 32}, conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
    )  # fmt: skip
    return tf.Wav2Vec2Model(config)


# directory name -> the transformers model saved there, made from a tiny config with random weights
HF_MODELS: dict[str, Callable[[Any], nn.Module]] = {
    "bert": lambda tf: tf.BertForSequenceClassification(tf.BertConfig(**TEXT, num_labels=3)),
    "roberta": lambda tf: tf.RobertaModel(tf.RobertaConfig(**TEXT, **SPECIAL)),
    "distilbert": lambda tf: tf.DistilBertForSequenceClassification(
        tf.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64)
    ),
    "albert": lambda tf: tf.AlbertForMaskedLM(tf.AlbertConfig(**TEXT, embedding_size=16, **SPECIAL)),
    "electra": lambda tf: tf.ElectraForTokenClassification(tf.ElectraConfig(**TEXT, embedding_size=16, num_labels=5)),
    "deberta-v2": lambda tf: tf.DebertaV2Model(tf.DebertaV2Config(**TEXT)),
    "mpnet": lambda tf: tf.MPNetModel(tf.MPNetConfig(**TEXT, **SPECIAL)),
    "xlm-roberta": lambda tf: tf.XLMRobertaForSequenceClassification(
        tf.XLMRobertaConfig(**TEXT, **SPECIAL, num_labels=2)
    ),
    "bart": _bart,
    "t5": lambda tf: tf.T5ForConditionalGeneration(
        tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    ),
    "gpt2": lambda tf: tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=2)
    ),
    "llama": lambda tf: tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)),
    "qwen2": lambda tf: tf.Qwen2ForCausalLM(tf.Qwen2Config(**DECODER)),
    "vit": lambda tf: tf.ViTForImageClassification(tf.ViTConfig(**VISION, num_labels=5)),
    "convnext": lambda tf: tf.ConvNextModel(
        tf.ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], image_size=32)
    ),
    "swin": lambda tf: tf.SwinForImageClassification(tf.SwinConfig(**SWIN, num_labels=5)),
    "clip-vision": lambda tf: tf.CLIPVisionModel(tf.CLIPVisionConfig(**VISION)),
    "wav2vec2": _wav2vec2,
    "whisper": _whisper,
}


def _tv(name: str, builder: str, **kw: Any) -> Arch:
    return Arch(name, "vision", "torchvision", builder, **kw)


def _hf(name: str, family: str, directory: str, task: str, **kw: Any) -> Arch:
    return Arch(name, family, "hf", directory, task, **kw)


ARCHS: tuple[Arch, ...] = (
    _tv("ResNet-50", "resnet50"),
    _tv("MobileNetV3-Small", "mobilenet_v3_small"),
    _tv("EfficientNet-B0", "efficientnet_b0"),
    _tv("ConvNeXt-Tiny", "convnext_tiny"),
    _tv("RegNetY-400MF", "regnet_y_400mf"),
    _tv("DenseNet-121", "densenet121"),
    _tv("SqueezeNet 1.0", "squeezenet1_0", aoti=True),
    _tv("ShuffleNetV2 x0.5", "shufflenet_v2_x0_5"),
    _tv("MNASNet 0.5", "mnasnet0_5"),
    _tv("ViT (torchvision)", "vit_tiny"),
    _hf("BERT", "text", "bert", "sequence-classification", aoti=True),
    _hf("RoBERTa", "text", "roberta", "feature-extraction"),
    _hf("DistilBERT", "text", "distilbert", "sequence-classification"),
    _hf("ALBERT", "text", "albert", "masked-lm"),
    _hf("ELECTRA", "text", "electra", "token-classification"),
    _hf("DeBERTa-v2", "text", "deberta-v2", "feature-extraction"),
    _hf("MPNet", "text", "mpnet", "feature-extraction"),
    _hf("XLM-RoBERTa", "text", "xlm-roberta", "sequence-classification"),
    _hf("BART encoder", "seq2seq", "bart", "text2text-encoder"),
    _hf("BART decoder step", "seq2seq", "bart", "text2text-decoder"),
    _hf("T5 encoder", "seq2seq", "t5", "text2text-encoder"),
    _hf("T5 decoder step", "seq2seq", "t5", "text2text-decoder"),
    _hf("GPT-2", "causal-lm", "gpt2", "causal-lm", aoti=True),
    _hf("Llama", "causal-lm", "llama", "causal-lm"),
    _hf("Qwen2", "causal-lm", "qwen2", "causal-lm"),
    _hf("ViT", "vision", "vit", "image-classification"),
    _hf("ConvNeXt", "vision", "convnext", "image-feature-extraction"),
    _hf("Swin", "vision", "swin", "image-classification"),
    _hf("CLIP vision tower", "vision", "clip-vision", "image-feature-extraction"),
    _hf("wav2vec2", "audio", "wav2vec2", "feature-extraction"),
    _hf("Whisper encoder", "audio", "whisper", "feature-extraction"),
)


def save_hf_models(root: Path, names: tuple[str, ...] | None = None) -> dict[str, Path]:
    """Save each of HF_MODELS (or ``names``) under ``root`` with random weights (seeded): name -> directory."""
    import transformers

    directories = {}
    with torch.random.fork_rng(devices=[]):
        for name in names or tuple(HF_MODELS):
            torch.manual_seed(list(HF_MODELS).index(name))  # the same weights whichever names are saved
            model = HF_MODELS[name](transformers)
            model.save_pretrained(root / name, safe_serialization=True)
            directories[name] = root / name
    return directories
