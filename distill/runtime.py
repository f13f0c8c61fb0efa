"""An exported student's ONNX form, run with ONNX Runtime and `tokenizers` alone: no torch, no optimum.

    from distill.runtime import OnnxEncoder
    vectors = OnnxEncoder("runs/demo/model", "onnx/model_qint8_avx512_vnni.onnx").encode(texts)

The folder is sentence-transformers' own (`modules.json`): its transformer runs from `onnx/<file>` (inputs
`input_ids`, `attention_mask` and, where the graph has it, `token_type_ids`; output `last_hidden_state`), and the
modules after it are read from their own folders and applied in numpy: Pooling (its `pooling_mode`), Dense
(`model.safetensors`, identity or tanh) and Normalize. sentence-transformers' `backend="onnx"` reads the same files
through optimum; this module exists because optimum does not import beside transformers 5 (docs/BENCHMARKS.md),
and a CPU server that runs the student needs neither.

Texts are tokenized as the folder's tokenizer does (`tokenizer.json`, truncated to `max_seq_length`), batched in
order of length so that a batch pads little, and returned in the order given.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from distill.errors import DistillError

ONNX_FILE = "onnx/model.onnx"  # sentence-transformers' name for a folder's float32 ONNX transformer
INSTALL = "pip install 'distill[onnx]' (onnx and onnxruntime)"
POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len_tokens", "lasttoken")
ACTIVATIONS = {"torch.nn.modules.linear.Identity": None, "torch.nn.modules.activation.Tanh": np.tanh}


def onnxruntime_module() -> Any:
    """ONNX Runtime, or one line that says how to install it."""
    try:
        import onnxruntime
    except ImportError:
        raise DistillError(f"the ONNX form needs ONNX Runtime, which is not installed: {INSTALL}") from None
    return onnxruntime


def _module_type(entry: dict) -> str:
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


class OnnxEncoder:
    """Unit (or as the folder ends) vectors of texts from a sentence-transformers folder's ONNX transformer."""

    def __init__(self, folder: str | os.PathLike, file_name: str = ONNX_FILE, threads: int | None = None):
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        modules_file = self.folder / "modules.json"
        onnx_file = self.folder / file_name
        if not modules_file.is_file() or not onnx_file.is_file():
            raise DistillError(
                f"{self.folder}: expected a sentence-transformers folder with {file_name} (an exported student "
                "with its ONNX form); export one with `python -m distill.train ... --save_to_artifacts True`"
            )
        modules = json.loads(modules_file.read_text())  # the first is the transformer the ONNX file replaces
        settings = json.loads((self.folder / "sentence_bert_config.json").read_text())
        self.max_length = int(settings.get("max_seq_length") or self._tokenizer_limit())
        self.tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(self.max_length)
        self.pad_id = self.tokenizer.padding["pad_id"] if self.tokenizer.padding else 0
        self.tokenizer.no_padding()  # each batch is padded here, to its own longest text
        self.steps = [self._step(entry) for entry in modules[1:]]
        ort = onnxruntime_module()
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}

    def _tokenizer_limit(self) -> int:
        config = self.folder / "tokenizer_config.json"
        limit = json.loads(config.read_text()).get("model_max_length") if config.is_file() else None
        return int(limit) if isinstance(limit, int) and limit < 1_000_000 else 512

    def _step(self, entry: dict) -> tuple[str, Any]:
        kind, path = _module_type(entry), self.folder / entry.get("path", "")
        if kind == "Pooling":
            config = json.loads((path / "config.json").read_text())
            mode = config.get("pooling_mode", "mean")
            if mode not in POOLING_MODES or config.get("include_prompt") is False:
                raise DistillError(
                    f"{path}: pooling {mode!r} is not one the ONNX runtime applies ({', '.join(POOLING_MODES)}); "
                    "run this folder with sentence-transformers instead"
                )
            return kind, mode
        if kind == "Dense":
            from safetensors.numpy import load_file

            config = json.loads((path / "config.json").read_text())
            weights = load_file(str(path / "model.safetensors"))
            activation = config.get("activation_function", "torch.nn.modules.linear.Identity")
            if activation not in ACTIVATIONS:
                raise DistillError(f"{path}: activation {activation} is not one the ONNX runtime applies")
            return kind, (weights["linear.weight"].T.astype(np.float32), weights.get("linear.bias"), activation)
        if kind == "Normalize":
            return kind, None
        raise DistillError(f"{path}: module {entry.get('type')} is not one the ONNX runtime applies")

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """(texts, dim) float32 vectors in the order of `texts`."""
        encodings = self.tokenizer.encode_batch(list(texts))
        order = np.argsort([len(e.ids) for e in encodings], kind="stable")
        out: np.ndarray | None = None
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            vectors = self._batch([encodings[i] for i in rows])
            if out is None:
                out = np.empty((len(texts), vectors.shape[1]), dtype=np.float32)
            out[rows] = vectors
        return out if out is not None else np.zeros((0, 0), dtype=np.float32)

    def _batch(self, encodings: list) -> np.ndarray:
        width = max(len(e.ids) for e in encodings)
        ids = np.full((len(encodings), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(encodings), width), dtype=np.int64)
        types = np.zeros((len(encodings), width), dtype=np.int64)
        for row, e in enumerate(encodings):
            ids[row, : len(e.ids)], mask[row, : len(e.ids)], types[row, : len(e.ids)] = e.ids, 1, e.type_ids
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        (tokens,) = self.session.run(["last_hidden_state"], {k: v for k, v in feeds.items() if k in self.inputs})
        vectors = tokens
        for kind, setting in self.steps:
            vectors = self._apply(kind, setting, vectors, mask)
        return np.asarray(vectors, dtype=np.float32)

    @staticmethod
    def _apply(kind: str, setting: Any, vectors: np.ndarray, mask: np.ndarray) -> np.ndarray:
        if kind == "Pooling":
            return pool(vectors, mask, setting)
        if kind == "Dense":
            weight, bias, activation = setting
            vectors = vectors @ weight + (0 if bias is None else bias)
            apply = ACTIVATIONS[activation]
            return apply(vectors) if apply is not None else vectors
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)  # Normalize


def pool(tokens: np.ndarray, mask: np.ndarray, mode: str) -> np.ndarray:
    """sentence-transformers' Pooling of (batch, length, dim) token vectors under the attention `mask`."""
    weights = mask[..., None].astype(tokens.dtype)  # (batch, length, 1)
    lengths = np.maximum(weights.sum(axis=1), 1e-9)  # (batch, 1)
    if mode == "cls":
        return tokens[:, 0]
    if mode == "max":
        return np.where(weights > 0, tokens, -1e9).max(axis=1)
    if mode == "lasttoken":
        return tokens[np.arange(len(tokens)), mask.sum(axis=1) - 1]
    summed = (tokens * weights).sum(axis=1)
    return summed / (np.sqrt(lengths) if mode == "mean_sqrt_len_tokens" else lengths)
