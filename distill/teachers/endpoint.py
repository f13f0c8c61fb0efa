"""A teacher behind an OpenAI-compatible embeddings endpoint: `--teacher_model openai/<model>`.

vLLM (`vllm serve MODEL --task embed`), Hugging Face text-embeddings-inference, infinity and the paid APIs
(OpenAI, and the many that speak its protocol) all answer `POST /v1/embeddings`. The `openai` client speaks the
protocol: the schema, base64 vectors, timeouts, and retries with exponential backoff and jitter on 408, 409, 429,
5xx and dropped connections, honouring Retry-After. What it lacks, written here:

- batching: each process sends its share of the texts (the cache shards them) in requests of at most
  --teacher_batch_size texts and REQUEST_TOKENS estimated tokens, IN_FLIGHT of them at once;
- a request the server refuses as too large (400, 413, 422) is sent again in halves;
- checks of every answer: one vector per text, all of one width (the one asked for with --teacher_dimensions);
- normalisation: the cache keeps unit vectors, whatever the server returns (a server's unit vectors as they come);
- the tokens the answers say they used (`usage`), in the progress bar and in one line at the end.

The API key is read from the environment variable --teacher_api_key_env names, when the client is made; it is
never a flag, and never written to config.yaml, results.json, the card, the logs or the cache. Vectors are cached
under the model's name, the dimensions and the prompt (not the URL): a run killed while it pays for an API
resumes from the cached blocks, and a server restarted on another port serves the same cache.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.logging import get_logger

from distill.errors import DistillError
from distill.store import Role
from distill.teachers.sources import Encoder, TeacherContext, TeacherKind

if TYPE_CHECKING:
    from accelerate import Accelerator

    from distill.config.schema import TeacherConfig
    from distill.stages.cost import CostTexts, ModelCost, TeacherCosts

logger = get_logger(__name__)

ENDPOINT_PREFIX = "openai/"  # --teacher_model openai/<model>, as LiteLLM and others name a provider's model
OPENAI_API = "https://api.openai.com/v1"
IN_FLIGHT = 4  # requests each process keeps open at once
REQUEST_TOKENS = 100_000  # estimated tokens per request, under the limits of the common servers and APIs
DEFAULT_REQUEST_TEXTS = 64  # texts per request when --teacher_batch_size is not given
BYTES_PER_TOKEN = 3  # the estimate: English BPE takes about 4 bytes a token; 3 errs on the safe side
MAX_RETRIES = 6  # the client's, for transient failures; its backoff doubles from 0.5 s to 8 s, with jitter
TIMEOUT_S = 120.0
NO_KEY = "sk-no-key"  # sent where the environment has no key: a local server needs none
TOO_LARGE = (400, 413, 422)  # the status codes servers answer a request over their size limits with
UNIT_TOLERANCE = 1e-5  # a vector this close to unit length is one


@dataclass
class Usage:
    """The tokens the endpoint says it used, over every request of this process."""

    tokens: int = 0
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, tokens: int) -> None:
        with self.lock:
            self.tokens += tokens
            self.requests += 1


class EndpointTeacher:
    """An OpenAI-compatible embeddings endpoint as the teacher."""

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        dimensions: int | None = None,
        query_prompt: str = "",
        document_prompt: str = "",
        request_texts: int | None = None,
    ):
        self.model = model
        self.base_url = base_url or OPENAI_API
        self.api_key_env = api_key_env
        self.dimensions = dimensions
        self.prompts = {"query": query_prompt, "document": document_prompt}
        self.request_texts = request_texts or DEFAULT_REQUEST_TEXTS
        self.name = f"{ENDPOINT_PREFIX}{model}"
        self.path = self.name  # what a cache manifest records
        self.revision: str | None = None
        self.max_seq_length: int | None = None
        self.loaded, self.load_seconds = False, 0.0  # nothing is loaded here
        self.usage = Usage()
        self.width: int | None = None  # every answer's vectors are this wide
        self._client: Any = None

    @classmethod
    def from_config(cls, name: str, config: TeacherConfig, request_texts: int | None = None) -> EndpointTeacher:
        """The endpoint `name` (openai/<model>) with the flags' settings; prompts are texts here (an endpoint
        declares none)."""
        return cls(
            name.removeprefix(ENDPOINT_PREFIX),
            config.teacher_base_url,
            config.teacher_api_key_env,
            config.teacher_dimensions,
            config.teacher_query_prompt or "",
            config.teacher_document_prompt or "",
            request_texts,
        )

    @property
    def cost_note(self) -> str:
        if self.served:
            return "a served model, timed through its endpoint; its size is not known here"
        return "the teacher is OpenAI's API, whose speed is not the model's and does not compare"

    @property
    def served(self) -> bool:
        """Whether the endpoint is a server of the user's (its speed compares with the student's), not OpenAI's API."""
        return self.base_url.rstrip("/") != OPENAI_API

    def prompt(self, role: Role) -> str:
        return self.prompts["query" if role == "query" else "document"]

    def identity(self, accelerator: Accelerator, memo: Path) -> str:
        return f"endpoint:{self.model}"

    def key_fields(self, role: Role) -> dict[str, object]:
        return {"prompt": self.prompt(role), "dimensions": self.dimensions, "normalize": True}

    def client(self) -> Any:
        """The `openai` client, made once (`openai_client`)."""
        if self._client is None:
            self._client = openai_client(self.base_url, self.api_key_env)
        return self._client

    def encoder(self, accelerator: Accelerator, texts: Sequence[str], role: Role) -> Encoder:
        """Requests of the texts at the indices of each batch, IN_FLIGHT at once; a batch is IN_FLIGHT requests."""
        prompt = self.prompt(role)
        inputs = [prompt + text for text in texts]
        lengths = np.fromiter((len(text.encode("utf8")) for text in inputs), dtype=np.int64, count=len(inputs))
        pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="distill-endpoint")
        before = (self.usage.requests, self.usage.tokens)

        def encode(indices: list[int]) -> torch.Tensor:
            requests = self.requests(indices, lengths)
            vectors = list(pool.map(lambda rows: self.request([inputs[i] for i in rows]), requests))
            return torch.from_numpy(np.concatenate(vectors))

        def done() -> None:
            pool.shutdown()
            requests, tokens = self.usage.requests - before[0], self.usage.tokens - before[1]
            logger.info(
                f"teacher {self.name} at {self.base_url}: this process sent its share of {len(texts):,} {role} texts "
                f"in {requests:,} requests, {tokens:,} tokens ({self.usage.tokens:,} in this run so far)",
                main_process_only=False,
            )

        return Encoder(
            lengths=lengths,
            encode=encode,
            batch_size=IN_FLIGHT * self.request_texts,
            too_long_hint="",
            done=done,
        )

    def requests(self, indices: list[int], lengths: np.ndarray) -> list[list[int]]:
        """`indices` cut into requests of at most `request_texts` texts and REQUEST_TOKENS estimated tokens."""
        requests: list[list[int]] = [[]]
        tokens = 0
        for i in indices:
            estimate = int(lengths[i]) // BYTES_PER_TOKEN + 1
            if requests[-1] and (len(requests[-1]) >= self.request_texts or tokens + estimate > REQUEST_TOKENS):
                requests.append([])
                tokens = 0
            requests[-1].append(i)
            tokens += estimate
        return [r for r in requests if r]

    def request(self, inputs: list[str]) -> np.ndarray:
        """(len(inputs), dim) unit vectors from one request, or from its halves where the server finds it too large."""
        import openai

        options: dict[str, Any] = {"dimensions": self.dimensions} if self.dimensions else {}
        try:
            response = self.client().embeddings.create(model=self.model, input=inputs, **options)
        except openai.APIStatusError as e:
            if e.status_code in TOO_LARGE and len(inputs) > 1:
                half = len(inputs) // 2
                return np.concatenate([self.request(inputs[:half]), self.request(inputs[half:])])
            problem = f"answered {e.status_code} ({first_words(e.message)})"
        except openai.APIConnectionError as e:  # timeouts and dropped connections, after the client's retries
            problem = f"could not be reached ({type(e).__name__}: {first_words(str(e))})"
        except (ValueError, TypeError) as e:  # an answer the client cannot read (not JSON, another schema)
            problem = f"answered what is not an embeddings response ({first_words(str(e))})"
        else:
            return self.vectors(response, len(inputs))
        raise DistillError(self.failure(problem))

    def vectors(self, response: Any, count: int) -> np.ndarray:
        """The response's vectors in input order, checked and made unit length."""
        data = sorted(getattr(response, "data", None) or [], key=lambda item: item.index)
        if len(data) != count:
            raise DistillError(self.failure(f"answered {len(data)} vectors for {count} texts"))
        widths = sorted({len(item.embedding) for item in data})
        with self.usage.lock:
            self.width = self.width or self.dimensions or widths[0]  # the first answer's, unless one was asked for
        if widths != [self.width]:
            asked = f"asked for {self.dimensions}" if self.dimensions else f"earlier answers had {self.width}"
            raise DistillError(self.failure(f"answered vectors of {', '.join(map(str, widths))} dimensions ({asked})"))
        vectors = np.asarray([item.embedding for item in data], dtype=np.float32)
        if not np.isfinite(vectors).all():
            raise DistillError(self.failure("answered vectors with NaN or inf values"))
        usage = getattr(response, "usage", None)
        self.usage.add(int(getattr(usage, "total_tokens", 0) or getattr(usage, "prompt_tokens", 0) or 0))
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        # rows the server normalised already stay as they are: dividing again would only move their last bits
        return np.where(np.abs(norms - 1) > UNIT_TOLERANCE, vectors / np.maximum(norms, 1e-12), vectors)

    def failure(self, what: str) -> str:
        return (
            f"teacher endpoint {self.base_url} (model {self.model!r}) {what}; check --teacher_base_url, "
            f"--teacher_model and the key in ${self.api_key_env}, then run again: the vectors cached so far are kept"
        )

    def cost(self, accelerator: Accelerator, texts: CostTexts, costs: TeacherCosts) -> ModelCost | None:
        """A served model's speed through its endpoint from this machine; None for OpenAI's API (paid per token,
        and its speed is not the model's)."""
        if not self.served:
            return None
        cost = costs.get(accelerator.device)
        if cost is None:
            from distill.stages.cost import measure_endpoint

            cost = measure_endpoint(self.request, texts, self.prompt("query"), self.prompt("document"))
            costs.put(cost)
        return cost

    def release(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def openai_client(base_url: str, api_key_env: str) -> Any:
    """The `openai` client of an endpoint: its retries and timeout; the key read from `api_key_env` now and kept only
    in the client (a placeholder where the environment has none: a local server needs none)."""
    import openai

    return openai.OpenAI(
        base_url=base_url,
        api_key=os.environ.get(api_key_env) or NO_KEY,
        max_retries=MAX_RETRIES,
        timeout=TIMEOUT_S,
    )


def first_words(message: str, limit: int = 160) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class EndpointKind(TeacherKind):
    """An OpenAI-compatible embeddings endpoint: `--teacher_model openai/<model>`."""

    name = "endpoint"
    scope = "an endpoint teacher"
    how = "pass --teacher_model openai/<model>"
    options = ("teacher_base_url", "teacher_dimensions")
    runs_here = False

    def claims(self, name: str) -> bool:
        return name.startswith(ENDPOINT_PREFIX)

    def make(self, name: str, settings: TeacherConfig, context: TeacherContext) -> EndpointTeacher:
        return EndpointTeacher.from_config(name, settings, context.batch_size)

    def where(self, name: str, settings: TeacherConfig) -> str:
        return f"{name} at {settings.teacher_base_url or OPENAI_API}"


ENDPOINT = EndpointKind()
