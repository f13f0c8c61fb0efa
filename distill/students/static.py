"""A static student: one vector per token, averaged, hundreds of times faster than a transformer on a CPU.

model2vec's distillation builds the table (every vocabulary token through a model, then PCA to the width asked
for, `--student_dim`); the phases then fit it to the teacher, phase 1 to its sentence vectors (model2vec's
own second step, tokenlearn), phase 2 to its in-batch similarities. sentence-transformers' `StaticEmbedding` holds
the table, so the loop, checkpoints, evaluation, the cost stage and export treat it as any student.

`--student_model static` distils the teacher's tokens; `static:<model>` another model's (where the teacher is an
endpoint or a vectors file); a model2vec folder or a SentenceTransformer folder whose first module is a
`StaticEmbedding` starts from that table. `--student_tokenizer` puts another tokenizer's vocabulary in the table
(for a teacher whose byte-level BPE does not suit one). Distilled tables are kept in the teacher cache folder, keyed
by the model's weights, the vocabulary and the width. The distillation's forward passes (one per vocabulary token)
are split over each machine's processes, each on its own device, and kept in files as they are done
(`distilled_embedding`), so a stopped job resumes where it stopped.

Texts are tokenized as model2vec tokenizes them (no special tokens, unknown tokens dropped), so the exported
model2vec folder gives the trained student's vectors. sentence-transformers' `StaticEmbedding` keeps unknown
tokens in its mean; their row is zero, so that mean points the same way, and after the Normalize the two folders
give the same vectors for any text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from distill.config.constraints import Scope
from distill.errors import DistillError
from distill.files import CONTENTS, check, mark_used, staged_folder
from distill.hub import ModelShape, config_folder, model_fingerprint, resolve_model, tokenizer_of
from distill.students.kinds import ExtraFolder, LoadContext, StudentDescription, StudentFigures, StudentKind
from distill.tokens import TokenizedTexts

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from distill.config.schema import StudentConfig, TeacherConfig
    from distill.stages.cost import CostTexts, ModelCost

logger = logging.getLogger(__name__)  # each process says what it finds in its own share
STATIC_NAME = "static"
DEFAULT_DIM = 256
MODEL2VEC_FOLDER = "model2vec"  # beside the SentenceTransformer folder in <artifacts_dir>


def is_static(name: str | None) -> bool:
    """Whether --student_model names a static student: `static`, `static:<model>`, or a static model's folder."""
    if not name:
        return False
    if name == STATIC_NAME or name.startswith(f"{STATIC_NAME}:"):
        return True
    folder = Path(name).expanduser()
    return folder.is_dir() and (_is_model2vec(folder) or _is_static_sentence_transformer(folder))


def _is_model2vec(folder: Path) -> bool:
    config = folder / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "model2vec"


def _is_static_sentence_transformer(folder: Path) -> bool:
    modules = folder / "modules.json"
    if not modules.is_file():
        return False
    first = (json.loads(modules.read_text()) or [{}])[0]
    return str(first.get("type", "")).endswith("StaticEmbedding")


def source_model(name: str, teacher_model: str | None) -> str:
    """The model whose tokens a `static` / `static:<model>` student is distilled from."""
    from distill.teachers import runs_here

    source = name.split(":", 1)[1] if ":" in name else teacher_model
    if not source or not runs_here(source):
        raise DistillError(
            "student_model static distils the teacher's token vectors, but the teacher is not one model loaded here; "
            "name the model to distil with --student_model static:<model> (a Hub name or a folder)"
        )
    return source


@dataclass(frozen=True)
class Distilling:
    """How a table is distilled (`distilled_embedding`): on which device and in what dtype the model runs, over
    whose vocabulary (`tokenizer`: another tokenizer's, else the model's own), and by which of the processes that
    distil together (`share`: this one's index and their count; `wait`: their barrier)."""

    device: str = "cpu"
    dtype: str = "float32"
    tokenizer: str | None = None
    share: tuple[int, int] = (0, 1)
    wait: Callable[[], object] = lambda: None


def load_static_student(
    name: str, teacher_model: str | None, dim: int | None, cache_dir: Path, how: Distilling = Distilling()
) -> SentenceTransformer:
    """The static student on `how.device`: a StaticEmbedding (the table) and a Normalize, from a folder or from
    model2vec's distillation of a model (kept in `cache_dir` for the next run)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, StaticEmbedding

    folder = Path(name).expanduser()
    if folder.is_dir() and _is_static_sentence_transformer(folder):
        student = SentenceTransformer(str(folder), device=how.device)
        static_table(student)  # a module that cannot fold into the table stops the run now, not at its export
    else:
        if folder.is_dir():
            embedding = StaticEmbedding.from_model2vec(str(folder))
        else:
            embedding = distilled_embedding(source_model(name, teacher_model), dim or DEFAULT_DIM, cache_dir, how)
        student = SentenceTransformer(modules=[embedding, Normalize()], device=how.device)
    # every token, as the model2vec export reads them: model2vec's loader leaves its own default of 512 on the
    # tokenizer, which StaticEmbedding would keep, and model2vec cuts by characters, not tokens, where it truncates
    student[0].tokenizer.no_truncation()
    with torch.no_grad():  # never trained (dropped from every batch)
        _zero_unknown_row(student[0].embedding.weight, student[0].tokenizer)
    # float32 whatever model2vec stored: the optimizer keeps float32 weights, mixed precision is autocast's
    return student.float()


TOKEN_CHUNK = 4096  # vocabulary tokens per kept folder of token vectors
TOKEN_VECTORS = "vectors.npy"
SIF_COEFFICIENT = 1e-4  # model2vec's default token weighting
UNUSED_TOKENS = r"\[unused\d+\]"  # model2vec's default: BERT's placeholder tokens leave the vocabulary


def distilled_embedding(source: str, dim: int, cache_dir: Path, how: Distilling = Distilling()) -> Any:
    """model2vec's distillation of `source` to `dim` dimensions as a StaticEmbedding, from the cache when kept.

    With `how.tokenizer` (a Hub name or folder), the table's rows are that tokenizer's vocabulary, each token run
    through `source` as the text it stands for (`surface_forms`), as model2vec runs the words of a vocabulary it is
    given: for a model whose own tokenizer does not suit a table (a byte-level BPE's 150k pieces, say).

    model2vec's `distill` runs every vocabulary token through the model in one process, in float32, and keeps
    nothing until it ends: a 7B model would take 28 GB of host memory per process to load, and a stopped job would
    start again. Here the same steps (its vocabulary cleaning, `create_embeddings`, SIF weights, PCA, float16) run
    with the tokens cut into files of TOKEN_CHUNK: file i is computed by process i mod n of `how.share` (index, n)
    on its own device, each kept as it is done, so the processes of a machine split the work and a stopped job
    resumes. The model loads straight onto the device in `how.dtype` (the teacher's: bfloat16 on a recent GPU,
    float32, model2vec's, elsewhere). After `how.wait` (every process calls it twice), the first process of the
    share builds the table and keeps it.
    """
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding

    model2vec = _model2vec()
    path = resolve_model(source)
    key = model_fingerprint(path)[:16]
    if how.tokenizer or how.dtype != "float32":  # the model's own vocabulary in float32 keeps model2vec's key
        vocabulary = model_fingerprint(resolve_model(how.tokenizer)) if how.tokenizer else ""
        key = hashlib.sha256(f"{key}:{vocabulary}:{how.dtype}".encode()).hexdigest()[:16]
    kept = Path(cache_dir).expanduser() / f"static-{key}-{dim}"
    if check(kept) is not None:
        tokenizer_model, vectors = token_vectors(path, kept.with_name(f"static-{key}-tokens"), how)
        how.wait()
        if how.share[0] == 0:
            with staged_folder(kept) as staging:  # whole or not at all; another machine's whole copy stays
                static_model(path, tokenizer_model, vectors(), dim).save_pretrained(str(staging))
        how.wait()
    mark_used(kept / CONTENTS)  # for `python -m distill.cache prune --unused_days`
    model = model2vec.StaticModel.from_pretrained(str(kept), force_download=False)
    return StaticEmbedding(model.tokenizer, embedding_weights=np.asarray(model.embedding), base_model=source)


def token_vectors(path: str, folder: Path, how: Distilling = Distilling()) -> tuple[Any, Callable[[], np.ndarray]]:
    """The cleaned vocabulary (a skeletoken TokenizerModel: the model's own, or that of `how.tokenizer`) and a
    reader of all its tokens' vectors, after this process has computed and kept its share of the files that are
    missing."""
    from model2vec.distill.inference import create_embeddings
    from model2vec.tokenizer import clean_and_create_vocabulary, turn_tokens_into_ids
    from skeletoken import TokenizerModel
    from transformers import AutoTokenizer

    def cleaned(folder: str) -> Any:
        return TokenizerModel.from_transformers_tokenizer(AutoTokenizer.from_pretrained(folder, use_fast=True))

    vocabulary = resolve_model(how.tokenizer) if how.tokenizer else None
    original = cleaned(path).prune_added_tokens()
    tokenizer_model = (original if vocabulary is None else cleaned(vocabulary).prune_added_tokens()).deep_copy()
    if tokenizer_model.adds_prefix_space is not None:
        tokenizer_model.adds_prefix_space = True
    tokenizer_model = clean_and_create_vocabulary(tokenizer_model, [], token_remove_regex=re.compile(UNUSED_TOKENS))
    tokens = tokenizer_model.sorted_vocabulary
    if vocabulary is not None:  # another tokenizer's tokens reach the model as text, through its own tokenizer
        tokens = surface_forms(tokenizer_model.to_tokenizer(), tokens)
    ids = turn_tokens_into_ids(tokens, original)
    if not ids:
        raise DistillError(
            f"{path} has no vocabulary tokens left to distil; a static student needs a tokenizer's vocabulary"
        )
    chunks = [ids[start : start + TOKEN_CHUNK] for start in range(0, len(ids), TOKEN_CHUNK)]
    shards = [  # each a sealed folder (distill/files.py): a torn or corrupt one is computed again
        folder / f"{i:05d}-{hashlib.sha256(json.dumps(chunk).encode()).hexdigest()[:12]}"
        for i, chunk in enumerate(chunks)
    ]
    mine = []
    for i in range(how.share[0], len(chunks), how.share[1]):
        problem = check(shards[i])
        if problem not in (None, "missing"):
            logger.warning(f"static token vectors {shards[i]} are {problem}; computing them again")
        if problem is not None:
            mine.append(i)
        else:
            mark_used(shards[i] / CONTENTS)
    if mine:
        from skeletoken.external.transformers import reshape_embeddings
        from transformers import AutoModel

        model = AutoModel.from_pretrained(path, dtype=getattr(torch, how.dtype), device_map=how.device)
        model = reshape_embeddings(model, original)
        for i in mine:
            vectors = create_embeddings(model, chunks[i], how.device, original.pad_token_id or 0)
            with staged_folder(shards[i]) as staging:
                np.save(staging / TOKEN_VECTORS, vectors)
        del model
    return tokenizer_model, lambda: np.concatenate([np.load(shard / TOKEN_VECTORS) for shard in shards])


def surface_forms(tokenizer: Any, tokens: list[str]) -> list[str]:
    """Each vocabulary token as the text it stands for: a word piece's continuation prefix dropped ('##ing' ->
    'ing'), byte-level and metaspace marks decoded ('Ġthe', '▁the' -> 'the'); a token that decodes to nothing
    stays as it is."""
    prefix = json.loads(tokenizer.to_str()).get("model", {}).get("continuing_subword_prefix") or ""

    def text(token: str) -> str:
        if prefix and token.startswith(prefix) and len(token) > len(prefix):
            token = token[len(prefix) :]
        decoded = tokenizer.decoder.decode([token]) if tokenizer.decoder is not None else token
        return decoded.strip() or token

    return [text(token) for token in tokens]


def static_model(path: str, tokenizer_model: Any, vectors: np.ndarray, dim: int) -> Any:
    """The table as model2vec's `distill_from_model` finishes it: SIF weights, PCA to `dim`, float16."""
    from model2vec.distill.inference import apply_pca, compute_weights
    from model2vec.quantization import DType, quantize_embeddings

    weights = compute_weights(len(vectors), sif_coefficient=SIF_COEFFICIENT)
    table = quantize_embeddings(apply_pca(vectors, dim) * weights[:, None], DType.Float16)
    config = {
        "model_type": "model2vec",
        "architectures": ["StaticModel"],
        "tokenizer_name": os.path.basename(path),
        "apply_pca": dim,
        "sif_coefficient": SIF_COEFFICIENT,
        "hidden_dim": table.shape[1],
        "seq_length": 1000000,
        "normalize": True,
        "pooling": "mean",
    }
    return _model2vec().StaticModel(
        vectors=table,
        tokenizer=tokenizer_model.to_tokenizer(),
        config=config,
        base_model_name=os.path.basename(path),
        normalize=True,
    )


def _model2vec() -> Any:
    try:
        import model2vec
        import skeletoken  # noqa: F401  (model2vec's distillation reads tokenizers through it)
    except ImportError as e:
        raise DistillError(
            f"a static student needs model2vec's distillation ({e.name} is missing); install it with: "
            'pip install "model2vec>=0.10" "skeletoken>=0.6,<0.7"'
        ) from None
    return model2vec


class StaticTexts(TokenizedTexts):
    """Texts tokenized as model2vec tokenizes them, batched as `StaticEmbedding` reads them (flat ids, offsets)."""

    def __init__(
        self,
        tokenizer: Any,
        texts: Sequence[str],
        max_length: float | None = None,
        pad_to_multiple_of: int = 1,
        **_: Any,
    ):
        # no truncation by default (a static model's max_seq_length is inf): neither export truncates either
        # (the model2vec folder's max_length is None, StaticEmbedding has none)
        max_length = int(max_length) if max_length and max_length != float("inf") else None
        self.max_length, self.pad_to_multiple_of = max_length or 0, pad_to_multiple_of
        unknown = _unknown_id(tokenizer)
        ids = [
            [token for token in encoding.ids if token != unknown]
            for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        ]
        if max_length:
            self.truncated = sum(len(x) > max_length for x in ids)
            ids = [x[:max_length] for x in ids]
        else:
            self.truncated = 0
        self.lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.ids = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(self.lengths.sum()))

    def features(self, indices: list[int]) -> dict[str, torch.Tensor]:
        rows = np.asarray(indices)
        starts, lengths = self.offsets[rows], self.lengths[rows]
        flat = np.concatenate([self.ids[s : s + n] for s, n in zip(starts, lengths)]) if len(rows) else self.ids[:0]
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        return {"input_ids": torch.from_numpy(flat.astype(np.int64)), "offsets": torch.from_numpy(offsets)}


def _zero_unknown_row(table: torch.Tensor, tokenizer: Any) -> None:
    """Zero the unknown token's row: model2vec drops the token, sentence-transformers' mean keeps it, and a zero row
    leaves that mean's direction alone, so after the Normalize both give the same vector."""
    unknown = _unknown_id(tokenizer)
    if unknown is not None:
        table[unknown] = 0


def _unknown_id(tokenizer: Any) -> int | None:
    """The tokenizer's unknown token, which model2vec drops (as `StaticModel.tokenize` does)."""
    model = json.loads(tokenizer.to_str()).get("model", {})
    token = model.get("unk_token")
    return tokenizer.token_to_id(token) if token else None


def static_table(student: SentenceTransformer) -> torch.Tensor | None:
    """The table a static student's sentence vector is the mean of, with every linear module after it folded in
    (a Matryoshka rotation, a projection): mean(E) W + b = mean(E W + b). None for any other student."""
    from sentence_transformers.sentence_transformer.modules import Normalize, StaticEmbedding

    modules = list(student)
    if not modules or not isinstance(modules[0], StaticEmbedding):
        return None
    table = modules[0].embedding.weight.detach().float().cpu()
    normalized = False  # a Normalize before a linear module only scales its input: it folds where there is no bias
    for module in modules[1:]:
        if isinstance(module, Normalize):
            normalized = True
            continue
        linear = isinstance(getattr(module, "activation_function", None), torch.nn.Identity)
        if not linear or (normalized and getattr(getattr(module, "linear", None), "bias", None) is not None):
            raise DistillError(
                f"a static student's {type(module).__name__} is not linear, or has a bias after a Normalize, so it "
                "cannot fold into the table both exports hold; start from a static folder whose modules after the "
                "table are Dense layers without activation (and without a bias after a Normalize)"
            )
        with torch.no_grad():
            table = module({"sentence_embedding": table})["sentence_embedding"].float().cpu()
    return table


def one_table(student: SentenceTransformer) -> SentenceTransformer:
    """A static student as users get it: one table, with every linear module after it folded in, and a Normalize.

    The same vectors as the student, to float32 rounding, from one lookup and mean a text (the model2vec folder's
    table); the unknown token's row stays zero, so both exports agree.
    """
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, StaticEmbedding

    table, first = static_table(student), student[0]
    assert table is not None, "one_table takes a static student"
    _zero_unknown_row(table, first.tokenizer)  # a bias folded in would have made it non-zero
    embedding = StaticEmbedding(first.tokenizer, embedding_weights=table, base_model=first.base_model)
    return SentenceTransformer(modules=[embedding, Normalize()], device=str(student.device))


def as_model2vec(student: SentenceTransformer) -> Any | None:
    """The student as a model2vec `StaticModel` (normalised, as trained, no truncation); None for any other student."""
    from model2vec import StaticModel

    table = static_table(student)
    if table is None:
        return None
    return StaticModel(vectors=table.numpy(), tokenizer=student[0].tokenizer, normalize=True, max_length=None)


def save_model2vec(student: SentenceTransformer, folder: Path, card: str) -> Path | None:
    """The student as a model2vec folder that `StaticModel.from_pretrained` loads."""
    model = as_model2vec(student)
    if model is None:
        return None
    model.save_pretrained(str(folder))
    (folder / "README.md").write_text(card)
    return folder


MODEL2VEC_NOTE = (
    "This folder is the same student as a model2vec model: `StaticModel.from_pretrained(path)` loads it, with "
    "every linear layer after the table folded into the table."
)
# a table read from a folder keeps its width and its vocabulary: these options shape a table distilled here
DISTILLED_HERE = Scope(
    "a static table distilled here (a folder's table keeps its own width and vocabulary)",
    "pass --student_model static or static:<model> to distil one",
    ("student_model",),
)


class StaticKind(StudentKind):
    """A table of token vectors: `static`, `static:<model>`, a model2vec folder, or a static SentenceTransformer."""

    name = "static table"
    scope = "a static student"
    how = "pass --student_model static"
    options = ("student_dim", "student_tokenizer")
    projection_bias = False  # export folds the projection in after the table's own Normalize

    def claims(self, name: str) -> bool:
        return is_static(name)

    def holds(self, model: SentenceTransformer) -> bool:
        from sentence_transformers.sentence_transformer.modules import StaticEmbedding

        return isinstance(next(iter(model), None), StaticEmbedding)

    def refuses(self, settings: StudentConfig) -> dict[str, Scope]:
        folder = Path(settings.student_model).expanduser().is_dir()
        return dict.fromkeys(self.options, DISTILLED_HERE) if folder else {}

    def describe(self, settings: StudentConfig, teacher: TeacherConfig) -> StudentDescription:
        """Its base model is the model its table was distilled from (`static`: the teacher's); it reads every token."""
        name = settings.student_model
        folder = Path(name).expanduser().is_dir()
        base = name if folder else name.split(":", 1)[1] if ":" in name else teacher.teacher_model or ""
        return StudentDescription(base_model=base, token_limit=None)

    def declared_dim(self, settings: StudentConfig, teacher: TeacherConfig) -> int | None:
        folder = Path(settings.student_model).expanduser().is_dir()  # its table's width is read when loaded
        return None if folder else settings.student_dim or DEFAULT_DIM

    def figures(self, settings: StudentConfig, teacher: TeacherConfig) -> StudentFigures:
        """A table of vocabulary size x width, which costs no FLOPs worth counting (a mean of looked-up rows)."""
        name = settings.student_model
        source = None
        if Path(name).expanduser().is_dir():
            folder = Path(name).expanduser()
            dim = int(json.loads((folder / "config.json").read_text()).get("hidden_dim") or DEFAULT_DIM)
        else:
            source = folder = config_folder(source_model(name, teacher.teacher_model), None)
            dim = settings.student_dim or DEFAULT_DIM
        vocabulary_from = config_folder(settings.student_tokenizer, None) if settings.student_tokenizer else folder
        tokenizer = tokenizer_of(vocabulary_from)
        vocabulary = len(tokenizer) if tokenizer is not None else 0
        shape = ModelShape(vocabulary * dim, vocabulary * dim, 0, 1, 0, dim, 0, dim)
        return StudentFigures(folder, shape, reads_every_token=True, table_source=source)

    def load(self, settings: StudentConfig, context: LoadContext) -> SentenceTransformer:
        how = Distilling(
            device=str(context.device),
            dtype=context.teacher_dtype,
            tokenizer=settings.student_tokenizer,
            share=context.share,
            wait=context.wait,
        )
        name, teacher = settings.student_model, context.teacher.teacher_model
        return load_static_student(name, teacher, settings.student_dim, context.cache_dir, how)

    def texts(self, model: SentenceTransformer) -> Callable[..., TokenizedTexts]:
        return StaticTexts

    def deployable(self, student: SentenceTransformer, head: list[Any]) -> SentenceTransformer:
        """Its linear modules (a rotation, a projection) fold into its table: one lookup and mean a text."""
        from sentence_transformers import SentenceTransformer

        return one_table(SentenceTransformer(modules=[*student, *head], device=str(student.device)))

    def extra_folders(self, deployable: SentenceTransformer) -> dict[str, ExtraFolder]:
        """A static table is also a model2vec model: its users load it there."""
        return {MODEL2VEC_FOLDER: ExtraFolder(MODEL2VEC_NOTE, partial(_save_folder, deployable))}

    def runtime_cost(self, student: SentenceTransformer, texts: CostTexts) -> ModelCost | None:
        """On a CPU, also model2vec's own runtime (`StaticModel.encode`, numpy)."""
        from distill.stages.cost import measure_model2vec

        model = as_model2vec(student) if student.device.type == "cpu" else None
        return measure_model2vec(model, texts) if model is not None else None


def _save_folder(student: SentenceTransformer, folder: Path, card: str) -> None:
    save_model2vec(student, folder, card)


STATIC = StaticKind()
