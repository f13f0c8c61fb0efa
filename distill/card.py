"""The exported model's card: sentence-transformers' generated card, with distill's own section in it.

sentence-transformers renders the card from a `SentenceTransformerModelCardData`: the YAML header that the Hub and
other tools read (base_model, datasets, language, license, tags, the scores as `metrics` and a `model-index`), then
the model's details, usage, evaluation tables, training datasets and versions. distill fills that data from the run
without asking the Hub, so the card is the same offline, and puts its own section before "Training Details": the
teacher and the mode, how to use the vectors, the evaluation table, what the student keeps and what it saves, and
every setting.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from textwrap import indent
from typing import TYPE_CHECKING, Any

from distill.data.reading import lenient
from distill.errors import DistillError
from distill.hub import resolve_model
from distill.results import negatives_phrase

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.model_card import SentenceTransformerModelCardData

    from distill.students.kinds import StudentDescription

TAGS = ["distillation"]
DISTILL_SECTION_BEFORE = "\n## Training Details\n"  # the generated card's heading distill's section goes above


@dataclass(frozen=True, eq=False)
class RunScores:
    """Scores distill computed (with sentence-transformers' metric code), shaped like an evaluator for the card.

    The card reads an evaluator's `name` (the dataset), `description` (the task), `primary_metric` and config.
    """

    name: str
    description: str
    primary_metric: str
    config: dict[str, Any] = field(default_factory=dict)

    def get_config_dict(self) -> dict[str, Any]:
        return self.config


def card_scores(figures: dict) -> dict[RunScores, dict[str, float]]:
    """The exported student's scores (`student_after` of results.json) as the card's evaluation entries."""
    after = figures.get("student_after") or {}
    scores: dict[RunScores, dict[str, float]] = {}
    retrieval = {f"cosine_{k}": after[k] for k in ("ndcg@10", "mrr@10") if isinstance(after.get(k), float)}
    datasets = after.get("datasets_ndcg@10") or {}
    name = "NanoBEIR_mean" if datasets else "held-out"
    if retrieval:
        queries = {"queries": len(after["ranks@10"])} if "ranks@10" in after else {}
        scores[RunScores(name, "Information Retrieval", "cosine_ndcg@10", queries)] = retrieval
    for dataset, value in datasets.items():  # NanoBEIR: each dataset, named as sentence-transformers' cards name it
        scores[RunScores(dataset, "Information Retrieval", "cosine_ndcg@10")] = {"cosine_ndcg@10": value}
    widths = sorted(((int(d), v) for d, v in (after.get("matryoshka_ndcg@10") or {}).items()), reverse=True)
    for dim, value in widths[1:]:  # the widest is the model's own width: the row above
        scores[RunScores(f"{name}-dim_{dim}", "Information Retrieval", "cosine_ndcg@10", {"truncate_dim": dim})] = {
            "cosine_ndcg@10": value
        }
    if isinstance(after.get("sts_spearman"), float):
        sts = RunScores("lee-sts", "Semantic Similarity", "spearman_cosine")
        scores[sts] = {"spearman_cosine": after["sts_spearman"]}
    return scores


def train_datasets(settings: dict, figures: dict) -> list[dict[str, Any]]:
    """One entry per trained phase: its data, the examples it trained on, its columns and its loss."""
    weights = {k: settings[k] for k in ("cosine_weight", "mse_weight") if k in settings}
    similarity = {k: settings[k] for k in ("kl_weight", "temperature") if k in settings}
    phase2_loss = "distill.losses.similarity_kl_loss"
    if settings.get("mnrl_weight"):  # the pairs' own labels trained phase 2 as well
        similarity |= {k: settings[k] for k in ("mnrl_weight", "mnrl_margin") if k in settings}
        phase2_loss += " + MultipleNegativesRankingLoss"
    phases = {
        "phase1": ("phase1_data", ["text"], "distill.losses.alignment_loss", weights),
        "phase2": ("phase2_data", ["query", "passage"], phase2_loss, {**weights, **similarity}),
    }
    entries = []
    for phase, figures_of_phase in (figures.get("phases") or {}).items():
        key, columns, loss, loss_config = phases[phase]
        negatives = figures_of_phase.get("negatives") or {}
        columns = columns + [f"negative_{i + 1}" for i in range(negatives.get("per_query", 0))]
        source = str(settings.get(key, ""))
        name = f"{lenient(source).label(phase)} (phase {phase[-1]})"
        entry: dict[str, Any] = {"name": name, "columns": columns}
        if dataset_id := lenient(source).hub_id:
            entry["id"] = dataset_id
        if figures_of_phase.get("examples"):
            entry["size"] = figures_of_phase["examples"]
        code = indent(f"```json\n{json.dumps(loss_config, indent=4)}\n```", "  ") if loss_config else ""
        entry["loss"] = {"fullname": loss, **({"config_code": code} if code else {})}
        entries.append(entry)
    return entries


def student_card_header(student_model: str) -> dict[str, Any]:
    """The YAML header of the student's own model card (its license, languages), from disk or the Hub's cache."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.repocard import metadata_load

    try:
        folder = Path(resolve_model(student_model))
    except DistillError:
        return {}
    readme: Path | str | None = folder / "README.md"
    if not folder.is_dir():
        readme = try_to_load_from_cache(student_model, "README.md")
    if not isinstance(readme, (str, Path)) or not Path(readme).is_file():
        return {}
    try:
        return metadata_load(Path(readme)) or {}
    except Exception:  # a card whose header does not parse: the card goes without its fields
        return {}


def card_data(
    settings: dict, figures: dict, student_kind: StudentDescription | None = None
) -> SentenceTransformerModelCardData:
    """sentence-transformers' card data for the exported model, filled from the run and never from the Hub."""
    from sentence_transformers.sentence_transformer.model_card import SentenceTransformerModelCardData

    student, teacher = base_model(settings, student_kind), teacher_name(settings)
    own = student_card_header(student) if student else {}
    data = SentenceTransformerModelCardData(
        language=own.get("language"),  # the student's own card's: its vocabulary is the student's
        license=own.get("license"),  # the student's weights carry their card's license (edit the card to change)
        model_name=f"{Path(student).name} distilled from {Path(teacher).name}" if student and teacher else None,
        model_id=settings.get("push_to_hub"),
        train_datasets=train_datasets(settings, figures),
        local_files_only=True,  # the card never waits on the Hub; distill fills base_model and datasets itself
        generate_widget_examples=False,
    )
    if student and not Path(student).expanduser().exists():  # a Hub name: the model the student starts from
        data.base_model = student
    data.datasets = [entry["id"] for entry in data.train_datasets if "id" in entry]
    data.eval_results_dict = card_scores(figures)
    data.add_tags(TAGS)
    return data


@contextmanager
def card_data_of(sentence_transformer: SentenceTransformer, data: SentenceTransformerModelCardData) -> Iterator[None]:
    """`data` as the model's card data while its card is written; the model's own put back afterwards.

    The card's usage example encodes three sentences, and `encode` puts the model in eval mode: a best-model
    export in the middle of a phase gets its training mode back, so dropout goes on as before.
    """
    own, training = sentence_transformer.model_card_data, sentence_transformer.training
    sentence_transformer.model_card_data = data
    data.register_model(sentence_transformer)
    try:
        yield
    finally:
        sentence_transformer.model_card_data = own
        sentence_transformer.train(training)


def model_card(
    sentence_transformer: SentenceTransformer,
    settings: dict,
    table: str,
    dims: dict[str, int],
    note: str = "",
    matryoshka: list[int] | None = None,
    figures: dict | None = None,
    student: StudentDescription | None = None,
) -> str:
    """sentence-transformers' card for the folder's model, with distill's section in it.

    `table`: the evaluation and cost tables; `dims`: {"student": its dimension}, plus {"output": the projection's}
    when the model ends with the projection; `note`: what the folder holds; `matryoshka`: the widths a Matryoshka
    student was trained to be truncated to (largest first); `figures`: results.json, for the header's scores;
    `student`: what its kind says of the student (its base model, what the run did to it).
    """
    from sentence_transformers.base.model_card import generate_model_card

    with card_data_of(sentence_transformer, card_data(settings, figures or {}, student)):
        generated = generate_model_card(sentence_transformer)
    section = distill_section(
        settings, table, dims, " ".join(filter(None, (note, phases_sentence(figures or {})))), matryoshka, student
    )
    head, found, tail = generated.partition(DISTILL_SECTION_BEFORE)
    return f"{head}\n{section}{found}{tail}" if found else f"{generated.rstrip()}\n\n{section}"


def base_model(settings: dict, student: StudentDescription | None = None) -> str:
    """The model the student starts from, as its kind names it (a table's: the model it was distilled from);
    without a kind's word, --student_model."""
    return student.base_model if student is not None else str(settings.get("student_model", ""))


def teacher_name(settings: dict) -> str:
    """The teacher as the card names it: the model or endpoint model (`openai/<model>`), else the vectors file."""
    model, vectors = settings.get("teacher_model"), settings.get("teacher_vectors")
    if model and vectors:
        return f"{model}, with vectors from {Path(vectors).name}"
    return str(model or (f"vectors from {Path(vectors).name}" if vectors else ""))


TERMS = {
    "cosine": "cosine",
    "mse": "squared distance",
    "similarity_kl": "the teacher's in-batch similarities (KL)",
    "mnrl": "the pairs' own labels (MultipleNegativesRankingLoss)",
    "reranker": "the reranker's scores",
}


def phases_sentence(figures: dict) -> str:
    """What trained each phase and what it added to nDCG@10, from results.json's phases ("" without them)."""
    said = []
    for phase, stats in (figures.get("phases") or {}).items():
        terms = [TERMS.get(name, name) for name in stats.get("terms") or {}]
        if not terms:
            continue
        gain = (stats.get("added") or {}).get("ndcg@10")
        added = f" ({gain:+.4f} nDCG@10)" if gain is not None else ""
        if negatives := negatives_phrase(stats):
            terms[-1] += f", with {negatives}"
        said.append(f"phase {phase[-1]} trained on {', '.join(terms)}{added}")
    sentence = "; ".join(said)
    return f"{sentence[:1].upper()}{sentence[1:]}." if said else ""


def reranker_sentence(settings: dict) -> str:
    """What phase 2 learned from a reranker, where one taught it ("" otherwise)."""
    reranker = settings.get("reranker_model")
    if not reranker or settings.get("skip_phase2"):
        return ""
    loss = {"kl_div": "a KL over each query's candidates", "margin_mse": "MarginMSE"}.get(
        str(settings.get("reranker_loss")), str(settings.get("reranker_loss"))
    )
    return f" Phase 2 also learned the scores of the reranker `{reranker}` on each query's candidates ({loss})."


def distill_section(
    settings: dict,
    table: str,
    dims: dict[str, int],
    note: str = "",
    matryoshka: list[int] | None = None,
    student: StudentDescription | None = None,
) -> str:
    """distill's part of the card: how the student was distilled, how to use its vectors, its scores and settings."""
    width = dims.get("output", dims.get("student"))
    done = student.done if student is not None else ""  # what the run did to it, as its kind says
    intro = (
        f"Distilled with `distill` from teacher `{teacher_name(settings)}` into "
        f"`{settings.get('student_model')}`"
        + (f" {done}" if done else "")
        + f" ({dims.get('student')}-d"
        + (f", projected to the teacher's {dims['output']}-d" if "output" in dims else "")
        + (", Matryoshka" if matryoshka else "")
        + ")."
        + (
            f" Phase 1 aligned it to `{settings['phase1_teacher_model']}`; phase 2 distilled the teacher's "
            "similarities."
            if settings.get("phase1_teacher_model")
            else ""
        )
        + reranker_sentence(settings)
        + (f" {note}" if note else "")
    )
    usage = [
        f"The vectors are {width}-d and unit length. No prompts: the student was distilled on texts as they are, "
        "so queries and documents are encoded alike (`encode_query` and `encode_document` add nothing; the "
        "teacher's prompts are not needed)."
    ]
    if "output" in dims:
        usage.append(
            f"The vectors lie in the teacher's {dims['output']}-d space: they can query an index of the teacher's own "
            "passage vectors (scored as `ndcg@10_asymmetric` below)."
        )
    if matryoshka:
        shorter = matryoshka[1] if len(matryoshka) > 1 else matryoshka[0]
        usage.append(
            f"Matryoshka: trained to be truncated to {', '.join(map(str, matryoshka))} dimensions (the first "
            f"coordinates carry the most): `SentenceTransformer(path, truncate_dim={shorter})`. Truncated vectors "
            "are not unit length: compare them with `model.similarity` (cosine), or encode with "
            "`normalize_embeddings=True` before a dot product."
        )
    settings_json = json.dumps(settings, indent=2, default=str)
    return (
        f"## Distillation\n\n{intro}\n\n"
        + "\n\n".join(usage)
        + f"\n\n### Scores and cost\n\n{table}\n\n"
        + f"### Distillation settings\n\n```json\n{settings_json}\n```\n"
    )
