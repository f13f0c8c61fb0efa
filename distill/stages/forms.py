"""The forms the student is served in, beside its float32 PyTorch weights, each measured in the run that makes it.

- `onnx/model.onnx`: the transformer alone, float32 (`torch.onnx.export`, opset 17; inputs `input_ids`,
  `attention_mask` and, where the tokenizer makes them, `token_type_ids`; output `last_hidden_state`).
- `onnx/model_qint8_avx512_vnni.onnx`: the same with its matrix products in int8, activations quantized at run
  time (ONNX Runtime's `quantize_dynamic`: QInt8 weights per output channel, QUInt8 activations, no reduced range;
  the word embeddings stay float32), as sentence-transformers names an `avx512_vnni` quantized export.

The folder's Pooling, Dense and Normalize stay its modules, so `SentenceTransformer(path, backend="onnx",
model_kwargs={"file_name": ...})` loads a form where optimum supports the installed transformers, and
`distill.runtime.OnnxEncoder` runs it with ONNX Runtime and `tokenizers` alone. Each form is timed on the run's
cost texts as the PyTorch student is, and scored on the run's evaluation set through that runtime: texts a second,
nDCG@10 against the PyTorch student's, and file size. A form below `QUALITY_LINE` of the student's nDCG@10 is said
in one line and never recommended. A static student has no ONNX form: model2vec's folder is its small one.

The deployable folder and both files are written into a staging folder, where each form is measured; the export
stage copies its `onnx/` into the model folder before that is renamed into place. ONNX forms are built on a CPU
run, or anywhere `--export_onnx true` asks for them.
"""

from __future__ import annotations

import logging
import shutil
import socket
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from distill.errors import DistillError, first_line
from distill.files import process_alive, unique_suffix
from distill.metrics import retrieval_ndcg
from distill.runtime import INSTALL, ONNX_FILE, OnnxEncoder
from distill.stages.cost import timed
from distill.stages.tradeoff import QUALITY_LINE

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from distill.data.containers import EvalSet
    from distill.stages.cost import CostTexts

logger = logging.getLogger(__name__)

INT8_FILE = "onnx/model_qint8_avx512_vnni.onnx"
OPSET = 17


@dataclass
class FormCost:
    """One served form of the student: its file, size, speed and quality against the PyTorch student."""

    name: str  # "ONNX float32", "ONNX int8"
    file: str  # in the exported folder
    file_bytes: int
    texts_per_second: float
    latency_ms: float
    ndcg: float | None  # nDCG@10 on the run's evaluation set; None without one
    share: float | None  # of the PyTorch student's nDCG@10
    speedup: float  # its texts a second over the PyTorch student's


def onnx_available() -> bool:
    """Whether onnx and ONNX Runtime import here (the `.[onnx]` extra)."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def wanted(setting: str, device: torch.device) -> bool:
    """Whether the run builds the ONNX forms: `--export_onnx true`, or `auto` on a CPU run with the extra installed.
    `true` without the extra is one line that says how to install it (checked before any training)."""
    if setting == "false":
        return False
    if setting == "true":
        if not onnx_available():
            raise DistillError(
                f"--export_onnx true needs onnx and ONNX Runtime: {INSTALL}, or pass --export_onnx false"
            )
        return True
    return device.type == "cpu" and onnx_available()


class TokenEmbeddings(torch.nn.Module):
    """The transformer as the ONNX graph holds it: token ids in, `last_hidden_state` out."""

    def __init__(self, transformer: torch.nn.Module, inputs: list[str]):
        super().__init__()
        self.transformer, self.inputs = transformer, inputs

    def forward(self, *features: torch.Tensor) -> torch.Tensor:
        return self.transformer(**dict(zip(self.inputs, features)), return_dict=True).last_hidden_state


def export_onnx(deployable: SentenceTransformer, transformer: torch.nn.Module, folder: Path) -> tuple[Path, Path]:
    """The float32 and int8 ONNX files of `transformer` (the deployable's first module's model), in `folder`."""
    import copy

    from onnxruntime.quantization import QuantType, quantize_dynamic

    inputs = [
        name
        for name in ("input_ids", "attention_mask", "token_type_ids")
        if name in deployable.tokenizer.model_input_names
    ]
    model = TokenEmbeddings(copy.deepcopy(transformer).float().cpu().eval(), inputs)
    example = deployable.tokenizer(["an example text", "and another"], padding=True, return_tensors="pt")
    dynamic = {name: {0: "batch", 1: "tokens"} for name in [*inputs, "last_hidden_state"]}
    float_file, int8_file = folder / ONNX_FILE, folder / INT8_FILE
    float_file.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on shapes it freezes: the axes above stay dynamic
        torch.onnx.export(
            model,
            tuple(example[name] for name in inputs),
            str(float_file),
            input_names=inputs,
            output_names=["last_hidden_state"],
            dynamic_axes=dynamic,
            opset_version=OPSET,
            dynamo=False,  # the TorchScript exporter: no onnxscript needed, and it takes a BERT's masks as they are
        )
    # Per-channel weights, matrix products only: on the demo's student per-tensor weights kept 96.6-97.3% of its
    # nDCG@10, and the word embeddings' Gather in int8 cost 0.6 points more; this keeps 99.5% (docs/BENCHMARKS.md).
    with quiet_root_logger():  # its advice to pre-process the graph: measured, it changes nothing here
        quantize_dynamic(
            str(float_file),
            str(int8_file),
            weight_type=QuantType.QInt8,
            per_channel=True,
            reduce_range=False,
            op_types_to_quantize=["MatMul"],
        )
    return float_file, int8_file


@contextmanager
def quiet_root_logger() -> Iterator[None]:
    """ONNX Runtime's quantizer writes its notes to the root logger: below errors, they are left out meanwhile."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def form_cost(
    name: str,
    folder: Path,
    file: str,
    texts: CostTexts,
    evaluation: EvalSet | None,
    pytorch: tuple[float, float | None],
) -> FormCost:
    """`file`'s form timed on the cost texts and scored on the evaluation set, against the PyTorch student's
    (texts a second, nDCG@10)."""
    encoder = OnnxEncoder(folder, file)
    batch = texts.batch_size
    _, speed, latency, _ = timed(
        lambda passages: encoder.encode(passages, batch),
        lambda q: encoder.encode([q], batch),
        texts,
        torch.device("cpu"),
    )
    ndcg = share = None
    if evaluation is not None:
        vectors = encoder.encode([*evaluation.queries, *evaluation.corpus], batch)
        queries, corpus = vectors[: len(evaluation.queries)], vectors[len(evaluation.queries) :]
        ndcg = retrieval_ndcg(queries, corpus, evaluation)
        share = None if not pytorch[1] else round(ndcg / pytorch[1], 4)
    return FormCost(
        name, file, (folder / file).stat().st_size, speed, latency, ndcg, share, round(speed / max(pytorch[0], 1e-9), 2)
    )


def measure_forms(
    deployable: SentenceTransformer,
    transformer: torch.nn.Module,
    folder: Path,
    texts: CostTexts,
    evaluation: EvalSet | None,
    pytorch: tuple[float, float | None],
) -> list[FormCost]:
    """Both ONNX forms written into `folder` and measured (see the module docstring); a form below the quality line
    is said in one line. A model the exporter cannot take is one warning: the PyTorch folder is exported as ever."""
    try:
        deployable.save(str(folder), create_model_card=False)  # the folder each form is read from, as it ships
        export_onnx(deployable, transformer, folder)
        forms = [form_cost(name, folder, file, texts, evaluation, pytorch) for name, file in FORMS]
    except Exception as e:  # torch.onnx's and ONNX Runtime's errors are many; none of them may cost the trained run
        remove(folder)
        logger.warning(f"no ONNX forms: {first_line(e, named=True)}; the PyTorch folder is exported as it is")
        return []
    for form in forms:
        if form.share is not None and form.share < QUALITY_LINE:
            logger.warning(
                f"{form.name} keeps {100 * form.share:.1f}% of the PyTorch student's nDCG@10, below "
                f"{100 * QUALITY_LINE:.0f}%: it is exported but not recommended"
            )
    return forms


FORMS = (("ONNX float32", ONNX_FILE), ("ONNX int8", INT8_FILE))


def staging_folder(artifacts_dir: str) -> Path:
    """A folder for the forms under the artifacts folder, named apart from every other process's
    (`.forms-<host>-<pid>-<random>`). What a killed run of this machine left there (about 120 MB on the demo) goes
    first: its process is gone."""
    root = Path(artifacts_dir).expanduser()
    for left in root.glob(f".forms-{socket.gethostname()}-*"):
        pid = left.name.removeprefix(f".forms-{socket.gethostname()}-").split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
    return root / f".forms-{unique_suffix()}"


def forms_to_dict(forms: list[FormCost]) -> list[dict[str, Any]]:
    return [asdict(form) for form in forms]


def remove(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
