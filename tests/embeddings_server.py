"""An OpenAI-compatible embeddings server and a rerank server for the tests, and a proxy that injects faults.

The server answers `POST /v1/embeddings` on 127.0.0.1 (a free port) with OpenAI's request and response schema,
float or base64 vectors alike, backed by a real SentenceTransformer. infinity-emb, the embedding server on PyPI,
pins numpy<2 and sentence-transformers<4 and cannot share the project's environment; this stand-in is small and
real where it matters: HTTP, the schema, the model's vectors.

The proxy forwards every request, or answers the next one with the fault its plan holds: a status (429 with
Retry-After, 500, 401), a dropped connection, a delay past the client's timeout, a wrong dimension or count, or
a body that is not JSON.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import numpy as np


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Local:
    """An HTTP server on a free local port, answering in a thread while the `with` block runs."""

    def serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = _Server(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @property
    def url(self) -> str:
        """The OpenAI-style base URL."""
        return f"{self.root}/v1"

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class EmbeddingsServer(_Local):
    """`model_path` served as `name` at `url` (…/v1), requiring the bearer `key` when one is given; each request's
    texts encoded `batch_size` at a time."""

    def __init__(
        self,
        model_path: Path,
        name: str,
        max_seq_length: int | None = None,
        key: str | None = None,
        batch_size: int = 32,
        max_inputs: int | None = None,
        too_large: int = 413,
    ):
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(model_path), device="cpu")
        if max_seq_length:
            self.model.max_seq_length = max_seq_length
        self.name, self.key, self.batch_size = name, key, batch_size
        # a request of more than `max_inputs` texts is refused with `too_large`, as servers refuse one over their size
        self.max_inputs, self.too_large = max_inputs, too_large
        self.lock = threading.Lock()  # one forward pass at a time
        self.requests: list[dict[str, Any]] = []
        self.serve(self._handler())

    def embed(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        inputs = body.get("input")
        inputs = [inputs] if isinstance(inputs, str) else inputs
        if body.get("model") != self.name:
            return 404, error(f"The model `{body.get('model')}` does not exist.", "invalid_request_error")
        if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) for t in inputs):
            return 400, error("'input' must be a string or a non-empty array of strings", "invalid_request_error")
        if self.max_inputs is not None and len(inputs) > self.max_inputs:
            return self.too_large, error(f"at most {self.max_inputs} inputs a request", "invalid_request_error")
        with self.lock:
            vectors = self.model.encode(
                inputs, batch_size=self.batch_size, convert_to_numpy=True, normalize_embeddings=True
            ).astype(np.float32)
            tokens = sum(len(ids) for ids in self.model.tokenizer(inputs, truncation=True)["input_ids"])
        if body.get("dimensions"):
            vectors = vectors[:, : body["dimensions"]]
        base64_vectors = body.get("encoding_format") == "base64"
        return 200, {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": base64.b64encode(v.tobytes()).decode() if base64_vectors else v.tolist(),
                }
                for i, v in enumerate(vectors)
            ],
            "model": self.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        return api_handler(self, "/v1/embeddings", self.embed)


class RerankServer(_Local):
    """The cross-encoder in `model_path` served as `name` at `url` (…/v1): `POST /v1/rerank` as vLLM, infinity, Cohere
    and Jina answer it (a query and its documents in; `results` of `index` and `relevance_score`, best first). Its
    scores are the model's raw logits. `documents` counts every document scored, over all requests."""

    def __init__(self, model_path: Path, name: str, key: str | None = None):
        import torch
        from sentence_transformers.cross_encoder import CrossEncoder

        self.model = CrossEncoder(str(model_path), device="cpu")
        self.identity = torch.nn.Identity()
        self.name, self.key = name, key
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.documents = 0
        self.serve(self._handler())

    def rerank(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        documents = body.get("documents")
        if body.get("model") != self.name:
            return 404, error(f"The model `{body.get('model')}` does not exist.", "invalid_request_error")
        if not isinstance(body.get("query"), str) or not isinstance(documents, list) or not documents:
            return 400, error("expected a query and a non-empty list of documents", "invalid_request_error")
        with self.lock:
            scores = self.model.predict([(body["query"], d) for d in documents], activation_fn=self.identity)
            self.documents += len(documents)
        order = np.argsort(-scores, kind="stable")[: body.get("top_n") or len(documents)]
        results = [{"index": int(i), "relevance_score": float(scores[i])} for i in order]
        return 200, {"id": "rerank", "model": self.name, "results": results, "usage": {"total_tokens": 0}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        return api_handler(self, "/v1/rerank", self.rerank)


class FaultProxy(_Local):
    """Forwards to `upstream` (…/v1), or answers with the next fault of `plan` (consumed one per request)."""

    def __init__(self, upstream: str):
        self.upstream = http.client.urlsplit(upstream)
        self.plan: deque[tuple] = deque()
        self.forwarded = 0  # requests that reached the server
        self.seen = 0
        self.fail_after: int | None = None  # once this many requests reached the server, every request gets a 401
        self.serve(self._handler())

    def forward(self, handler: BaseHTTPRequestHandler, raw: bytes) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        headers = {k: v for k, v in handler.headers.items() if k.lower() in ("authorization", "content-type")}
        connection.request("POST", handler.path, body=raw, headers=headers)
        response = connection.getresponse()
        status, body = response.status, response.read()
        connection.close()
        self.forwarded += 1
        return status, body

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                proxy.seen += 1
                if proxy.fail_after is not None and proxy.forwarded >= proxy.fail_after:
                    return send(self, 401, error("Incorrect API key provided", "invalid_request_error"))
                fault = proxy.plan.popleft() if proxy.plan else ("forward",)
                kind = fault[0]
                if kind == "status":
                    return send(self, fault[1], error("injected", "server_error"), fault[2] if len(fault) > 2 else {})
                if kind == "drop":
                    self.close_connection = True
                    return self.connection.close()  # no answer at all
                if kind == "sleep":
                    time.sleep(fault[1])
                if kind == "malformed":
                    return send_raw(self, 200, b'{"object": "list", "data": [{"embedd')
                status, body = proxy.forward(self, raw)
                if kind in ("wrong_dim", "wrong_count") and status == 200:
                    answer = json.loads(body)
                    if kind == "wrong_count":
                        answer["data"] = answer["data"][:-1]
                    else:
                        for item in answer["data"]:
                            item["embedding"] = shorten(item["embedding"])
                    body = json.dumps(answer).encode()
                send_raw(self, status, body)

        return Handler


def api_handler(server: Any, path: str, answer: Any) -> type[BaseHTTPRequestHandler]:
    """A handler that records each request in `server.requests`, checks the path and the bearer `server.key`, and
    sends what `answer(body)` returns."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            server.requests.append({"authorization": self.headers.get("Authorization"), "body": body})
            if self.path != path:
                return send(self, 404, error("not found", "invalid_request_error"))
            if server.key is not None and self.headers.get("Authorization") != f"Bearer {server.key}":
                return send(self, 401, error("Incorrect API key provided", "invalid_request_error"))
            send(self, *answer(body))

    return Handler


def shorten(embedding: str | list[float]) -> str | list[float]:
    """The vector one dimension short, in the encoding it came in."""
    if isinstance(embedding, list):
        return embedding[:-1]
    vector = np.frombuffer(base64.b64decode(embedding), dtype=np.float32)[:-1]
    return base64.b64encode(vector.tobytes()).decode()


def error(message: str, kind: str) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def send(handler: BaseHTTPRequestHandler, status: int, payload: dict, headers: dict | None = None) -> None:
    send_raw(handler, status, json.dumps(payload).encode(), headers)


def send_raw(handler: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict | None = None) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)
