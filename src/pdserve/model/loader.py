"""Load a checkpoint directory (single or sharded safetensors, or a converted GGUF file) into this
rank's model, quantizing its weights at load when `--quantization` asks.

Runs in every TP rank; each rank reads only the tensors it needs and slices its shard. The weight
format is also named here for the P/D fingerprint (`weight_format`), from the engine process.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.model.gguf_weights import GGUFWeights, source_file, tensor_types
from pdserve.model.llama import CausalLM
from pdserve.model.parallel import TPGroup
from pdserve.model.quant import Weight, quantize_for
from pdserve.model.spec import ModelSpec


class CheckpointReader:
    """name -> tensor over every safetensors file of a checkpoint (opened lazily, read on demand)."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: model_dir / f for name, f in weight_map.items()}
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
            self._file_of = {}
            for path in files:
                with safe_open(path, framework="pt") as f:
                    self._file_of.update({name: path for name in f.keys()})
        self._open: dict[Path, object] = {}

    def __call__(self, name: str) -> torch.Tensor:
        path = self._file_of.get(name)
        if path is None:
            raise KeyError(f"checkpoint has no tensor named {name!r}")
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path].get_tensor(name)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of


class QuantizingReader:
    """A checkpoint's tensors, each matrix quantized as it is read (quant.quantize_for)."""

    def __init__(self, reader: CheckpointReader, quantization: str):
        self.reader, self.quantization = reader, quantization

    def __call__(self, name: str) -> Weight:
        return quantize_for(name, self.reader(name), self.quantization)

    def __contains__(self, name: str) -> bool:
        return name in self.reader


def load_model(model_dir: str | Path, spec: ModelSpec, tp: TPGroup, dtype: torch.dtype,
               quantization: str | None = None) -> CausalLM:
    gguf_path = source_file(model_dir)
    if gguf_path is not None:
        reader = GGUFWeights(gguf_path, quantization)
    elif quantization in ("int8", "int4"):
        reader = QuantizingReader(CheckpointReader(model_dir), quantization)
    else:
        reader = CheckpointReader(model_dir)
    if not spec.tie_word_embeddings and "lm_head.weight" not in reader:
        # Some checkpoints tie the head without saying so in config.json.
        spec = type(spec)(**{**spec.__dict__, "tie_word_embeddings": True})
    return CausalLM(spec, tp, reader, dtype)


def weight_format(model_dir: str | Path, quantization: str | None) -> str:
    """What the weights will be, for peers to compare: the mode ("none", "int8", "int4", or "gguf"
    for a GGUF file's own formats) and, for a GGUF file, its tensor types (two files of one model
    quantized differently hold different weights whatever the mode)."""
    gguf_path = source_file(model_dir)
    if gguf_path is None:
        return quantization or "none"
    return f"{quantization or 'gguf'}/{','.join(tensor_types(gguf_path))}"
