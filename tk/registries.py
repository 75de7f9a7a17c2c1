"""The names of engines, export formats and precisions, and where each one's code lives.

This module is the registry the command line, the loaders and the tests all read, and it imports
nothing heavy, so ``tk --help`` stays fast. Adding an engine or a format is one file plus one
line here.
"""

from __future__ import annotations

# engine name -> "module:Class" (imported on first use by tk.runtime.registry.engine_class)
ENGINES: dict[str, str] = {
    "eager": "tk.runtime.eager:EagerEngine",
    "compile": "tk.runtime.eager:CompiledEngine",
    "torch": "tk.runtime.exported:ExportedProgramEngine",
    "aoti": "tk.runtime.aoti:AOTInductorEngine",
    "onnx": "tk.runtime.onnxrt:OnnxRuntimeEngine",
    "trt": "tk.runtime.tensorrt:TensorRTEngine",
    "openvino": "tk.runtime.openvino:OpenVINOEngine",
}

# engine name -> the artifact file role it runs (eager and compile rebuild the model from its weights)
ENGINE_FILE_ROLE: dict[str, str] = {
    "eager": "weights",
    "compile": "weights",
    "torch": "torch",
    "aoti": "aoti",
    "onnx": "onnx",
    "trt": "trt",
    "openvino": "openvino",
}

# export format -> its writer object, "module:OBJECT" (a tk.export.base.Writer; see tk.export.registry)
FORMATS: dict[str, str] = {
    "torch": "tk.export.program.writer:WRITER",
    "onnx": "tk.export.onnx.writer:WRITER",
    "aoti": "tk.export.aoti.writer:WRITER",
    "trt": "tk.export.tensorrt.writer:WRITER",
    "openvino": "tk.export.openvino.writer:WRITER",
}

PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "int8")
DEVICES = ("cpu", "cuda")

# tasks of a Hugging Face model directory (hf:DIR); tk.models.hf_tasks maps each to a transformers class
HF_TASKS = (
    "feature-extraction",
    "sequence-classification",
    "token-classification",
    "masked-lm",
    "image-classification",
    "image-feature-extraction",
    "causal-lm",
    "text2text-encoder",
    "text2text-decoder",
    "text-generation",
)
