"""A served reranker: `--reranker_model <model> --reranker_base_url <url>`.

vLLM (`vllm serve MODEL --task score`), infinity, and the Cohere and Jina APIs answer the rerank protocol:
`POST <url>/rerank` with a model, a query and its documents; the answer's `results` hold each document's `index` and
`relevance_score`. The `openai` client sends it (its generic `post`): the same timeouts, and the same retries with
backoff on 408, 409, 429, 5xx and dropped connections, honouring Retry-After, as the embeddings endpoint
(distill/teachers/endpoint.py). What it lacks, written here: one request per query with the documents of its pairs
that a batch holds, IN_FLIGHT requests at once, and checks of every answer (one finite score per document).

The key is read from the environment variable --reranker_api_key_env names, when the client is made, and is written
nowhere. Scores are cached under the model's name (not the URL): a run stopped while it pays for an API resumes from
the cached blocks and asks for no pair twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.logging import get_logger

from distill.errors import DistillError
from distill.store import Role
from distill.teachers.endpoint import DEFAULT_REQUEST_TEXTS, IN_FLIGHT, Usage, first_words, openai_client
from distill.teachers.reranker import check_scores, split_pair
from distill.teachers.sources import Encoder

if TYPE_CHECKING:
    from accelerate import Accelerator

    from distill.stages.cost import CostTexts, ModelCost, TeacherCosts

logger = get_logger(__name__)


class RerankEndpoint:
    """A reranker behind `POST <base_url>/rerank`."""

    revision: str | None = None
    max_seq_length: int | None = None
    cost_note = "a served reranker: its speed does not compare with an embedding model's"

    def __init__(self, model: str, base_url: str, api_key_env: str, request_texts: int | None = None):
        self.model, self.base_url, self.api_key_env = model, base_url.rstrip("/"), api_key_env
        self.request_texts = request_texts or DEFAULT_REQUEST_TEXTS  # documents per request at most
        self.name = self.path = model
        self.loaded, self.load_seconds = False, 0.0
        self.usage = Usage()
        self._client: Any = None

    def prompt(self, role: Role) -> str:
        return ""

    def identity(self, accelerator: Accelerator, memo: Path) -> str:
        return f"rerank-endpoint:{self.model}"

    def key_fields(self, role: Role) -> dict[str, object]:
        return {"scores": "relevance_score"}

    def client(self) -> Any:
        """The `openai` client, made once (`openai_client`)."""
        if self._client is None:
            self._client = openai_client(self.base_url, self.api_key_env)
        return self._client

    def encoder(self, accelerator: Accelerator, texts: Sequence[str], role: Role) -> Encoder:
        """Each batch's pairs as one request per query, IN_FLIGHT at once.

        Every pair of a query gets the same length key, unique to the query, so the cache's longest-first order
        keeps a query's pairs together and a batch asks for them in one request (two where a block or a process
        boundary cuts them).
        """
        pairs = [split_pair(text) for text in texts]
        sizes: dict[str, int] = {}
        for query, passage in pairs:
            sizes[query] = sizes.get(query, len(query)) + len(passage)
        rank = {query: n for n, query in enumerate(sizes)}
        lengths = np.asarray([sizes[q] * len(sizes) + rank[q] for q, _ in pairs], dtype=np.int64)
        pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="distill-rerank")
        before = self.usage.requests

        def score(indices: list[int]) -> torch.Tensor:
            groups: dict[str, list[int]] = {}
            for i in indices:
                groups.setdefault(pairs[i][0], []).append(i)
            step = self.request_texts
            requests = [(q, rows[s : s + step]) for q, rows in groups.items() for s in range(0, len(rows), step)]
            answers = pool.map(lambda r: self.request(r[0], [pairs[i][1] for i in r[1]]), requests)
            scores = np.empty(len(indices), dtype=np.float32)
            where = {index: n for n, index in enumerate(indices)}
            for (_, rows), answer in zip(requests, answers):
                scores[[where[i] for i in rows]] = answer
            return torch.from_numpy(scores[:, None])

        def done() -> None:
            pool.shutdown()
            logger.info(
                f"reranker {self.model} at {self.base_url}: this process sent its share of {len(texts):,} pairs in "
                f"{self.usage.requests - before:,} requests",
                main_process_only=False,
            )

        return Encoder(
            lengths=lengths,
            encode=score,
            batch_size=IN_FLIGHT * self.request_texts,
            too_long_hint="",
            check=check_scores(self.model),  # type: ignore[arg-type]
            done=done,
        )

    def request(self, query: str, documents: list[str]) -> np.ndarray:
        """Each document's relevance score to `query`, in the documents' order, from one request."""
        import openai

        body = {
            "model": self.model,
            "query": query,
            "documents": documents,
            "top_n": len(documents),
            "return_documents": False,
        }
        try:
            answer = self.client().post("/rerank", body=body, cast_to=object)
        except openai.APIStatusError as e:
            problem = f"answered {e.status_code} ({first_words(e.message)})"
        except openai.APIConnectionError as e:  # timeouts and dropped connections, after the client's retries
            problem = f"could not be reached ({type(e).__name__}: {first_words(str(e))})"
        except (ValueError, TypeError) as e:  # an answer that is not JSON
            problem = f"answered what is not a rerank response ({first_words(str(e))})"
        else:
            return self.scores(answer, len(documents))
        raise DistillError(self.failure(problem))

    def scores(self, answer: Any, count: int) -> np.ndarray:
        """The answer's scores in document order, checked: one finite number per document."""
        results = answer.get("results") if isinstance(answer, dict) else None
        scores = np.full(count, np.nan, dtype=np.float32)
        try:
            for item in results or []:
                scores[int(item["index"])] = float(item["relevance_score"])
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise DistillError(self.failure(f"answered what is not a rerank response ({first_words(str(e))})")) from e
        if not np.isfinite(scores).all():
            raise DistillError(self.failure(f"answered {len(results or [])} finite scores for {count} documents"))
        self.usage.add(0)
        return scores

    def failure(self, what: str) -> str:
        return (
            f"reranker endpoint {self.base_url} (model {self.model!r}) {what}; check --reranker_base_url, "
            f"--reranker_model and the key in ${self.api_key_env}, then run again: the scores cached so far are kept"
        )

    def cost(self, accelerator: Accelerator, texts: CostTexts, costs: TeacherCosts) -> ModelCost | None:
        return None

    def release(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
