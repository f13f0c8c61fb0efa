"""A stand-in for the Hugging Face Hub's HTTP API on a free local port: the calls sentence-transformers'
`push_to_hub` makes through `HfApi` (create the repository, validate the card's header, ask each file's upload
mode, commit the files as they are), and `HfApi.dataset_info` for the datasets it is told of. It keeps each
repository's visibility and files, and every request."""

from __future__ import annotations

import base64
import json
from http.server import BaseHTTPRequestHandler
from typing import Any

from embeddings_server import _Local


class HubServer(_Local):
    def __init__(self, fail_commits: bool = False) -> None:
        self.repos: dict[str, dict[str, Any]] = {}  # repo id -> {"private": bool, "files": {path: bytes}}
        self.datasets: dict[str, str] = {}  # dataset id -> the commit its default branch is at
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, authorization)
        self.fail_commits = fail_commits
        self.card_headers: list[str] = []  # the model cards sent for validation
        self.serve(self._handler())

    @property
    def url(self) -> str:
        """The Hub's endpoint (HF_ENDPOINT)."""
        return self.root

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def answer(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                hub.requests.append(("GET", self.path, self.headers.get("Authorization")))
                parts = self.path.split("?")[0].strip("/").split("/")
                dataset = "/".join(parts[2:4])
                if parts[:2] == ["api", "datasets"] and dataset in hub.datasets:
                    return self.answer(200, {"id": dataset, "sha": hub.datasets[dataset], "private": False})
                self.answer(404, {"error": f"the stand-in does not serve {self.path}"})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hub.requests.append(("POST", self.path, self.headers.get("Authorization")))
                parts = self.path.strip("/").split("/")
                if self.path == "/api/validate-yaml":  # a commit holding a model card has its header checked first
                    hub.card_headers.append(json.loads(raw)["content"])
                    return self.answer(200, {"errors": [], "warnings": []})
                if self.path == "/api/repos/create":
                    body = json.loads(raw)
                    repo = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
                    hub.repos.setdefault(
                        repo, {"private": body.get("visibility") == "private" or bool(body.get("private")), "files": {}}
                    )
                    return self.answer(200, {"url": f"{hub.url}/{repo}", "name": repo})
                if len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "preupload":
                    files = json.loads(raw)["files"]
                    return self.answer(
                        200,
                        {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]},
                    )
                if len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "commit":
                    if hub.fail_commits:  # 403: no rights, which the client does not retry (a 5xx it retries)
                        return self.answer(403, {"error": "the stand-in refuses commits"})
                    repo = f"{parts[2]}/{parts[3]}"
                    for line in raw.decode().splitlines():
                        item = json.loads(line)
                        if item.get("key") == "file":
                            hub.repos[repo]["files"][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    oid = f"{len(hub.requests):040x}"
                    return self.answer(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid})
                self.answer(404, {"error": f"the stand-in does not serve {self.path}"})

        return Handler
