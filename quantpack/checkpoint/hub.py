"""Resolve a conversion source: a local checkpoint directory or a Hugging Face hub repo id.

Hub sources go through ``huggingface_hub.snapshot_download`` with the normal cache, ``--revision``,
``--token``/``HF_TOKEN`` and ``HF_HUB_OFFLINE``, downloading only the files a conversion needs
(the safetensors weights the index names, JSON configs, tokenizer files, chat template, license, readme; the
checkpoint's code only with ``trust_remote_code``).
Every failure is a one-line :class:`~quantpack.checkpoint.CheckpointError`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .metadata import CheckpointError

# What a conversion reads or copies besides the weights, fetched first; then only the safetensors files the index
# names (else model.safetensors), as transformers reads them: never a consolidated.safetensors or other weight
# formats beside them (.bin unless allowed, .pth, .gguf, onnx, flax), and code only with trust_remote_code.
ALLOW_PATTERNS = ["*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.md", "LICENSE*", "NOTICE*", "USE_POLICY*"]
CODE_PATTERNS = ["*.py"]
PICKLE_PATTERNS = ["pytorch_model*.bin"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass(frozen=True)
class ResolvedSource:
    path: Path  # directory holding the checkpoint files
    repo: str  # hub repo id, or the absolute local path
    revision: str | None  # resolved commit for a hub source
    local: bool

    @property
    def name(self) -> str:
        """Model name for the default output directory: the last part of the repo id or path."""
        return self.repo.rstrip("/").split("/")[-1]


def looks_like_path(source: str) -> bool:
    return source.startswith((".", "/", "~")) or "\\" in source or source.count("/") > 1 or not _REPO_ID.match(source)


def resolve_source(source, *, revision: str | None = None, token: str | None = None,
                   allow_pickle: bool = False, trust_remote_code: bool = False) -> ResolvedSource:
    """Return where the checkpoint files of ``source`` are on disk (downloading from the hub if needed)."""
    source = str(source)
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"source: {source} is a file; pass the checkpoint directory or a hub repo id")
        if revision is not None:
            raise CheckpointError(f"revision: --revision applies to hub repos, but {source} is a local directory")
        return ResolvedSource(path.resolve(), str(path.resolve()), None, True)
    if looks_like_path(source):
        raise CheckpointError(f"source: no such directory: {source}, and it is not a hub repo id (owner/name)")
    if path.parent != Path(".") and path.parent.is_dir():  # `dir/name` with a local `dir`: a path, mistyped
        raise CheckpointError(f"source: no such directory: {source} ({path.parent} exists but holds no {path.name}); "
                              f"check the path")
    return _download(source, revision=revision, token=token, allow_pickle=allow_pickle,
                     trust_remote_code=trust_remote_code)


def _weight_files(folder: Path) -> list[str]:
    """The safetensors files transformers reads from a snapshot holding the small files: the index's shards, else
    model.safetensors (a broken index is left for SourceCheckpoint to report)."""
    import glob
    import json

    from .metadata import SAFE_INDEX_NAME, SAFE_SINGLE_NAME

    try:
        weight_map = json.loads((folder / SAFE_INDEX_NAME).read_text())["weight_map"]
    except FileNotFoundError:
        return [SAFE_SINGLE_NAME]
    except (OSError, ValueError, TypeError, KeyError):
        return []
    names = set(weight_map.values()) if isinstance(weight_map, dict) else set()
    return sorted(glob.escape(n) for n in names if isinstance(n, str) and n.endswith(".safetensors"))


def _download(repo_id: str, *, revision, token, allow_pickle, trust_remote_code) -> ResolvedSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    patterns = ALLOW_PATTERNS + (CODE_PATTERNS if trust_remote_code else [])
    try:
        # local_files_only under HF_HUB_OFFLINE: some huggingface_hub 1.x releases otherwise list the repo
        # tree online for an explicit commit even when offline
        folder = snapshot_download(repo_id, revision=revision, token=token, allow_patterns=patterns,
                                   local_files_only=bool(constants.HF_HUB_OFFLINE))
        weights = _weight_files(Path(folder)) + (PICKLE_PATTERNS if allow_pickle else [])
        if weights:  # the same commit as the small files
            commit = Path(folder).name if Path(folder).parent.name == "snapshots" else revision
            folder = snapshot_download(repo_id, revision=commit, token=token, allow_patterns=weights,
                                       local_files_only=bool(constants.HF_HUB_OFFLINE))
    except GatedRepoError:
        raise CheckpointError(f"source: {repo_id} is gated; accept its license on huggingface.co and pass --token "
                              f"or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"source: repository {repo_id} not found on the Hugging Face Hub (if it is private, "
                              f"pass --token or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"revision: {revision!r} does not exist in {repo_id}; pass a branch, tag or commit "
                              f"that exists") from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise CheckpointError(f"source: {repo_id} (revision {revision or 'main'}) is not in the Hugging Face cache "
                                  f"and HF_HUB_OFFLINE is set; download it once online or unset HF_HUB_OFFLINE") from None
        raise CheckpointError(f"source: cannot reach the Hugging Face Hub and {repo_id} is not cached; check the "
                              f"connection or pass a local directory") from None
    except HfHubHTTPError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"source: Hugging Face Hub error for {repo_id}: {first}") from None
    except OSError as e:
        raise CheckpointError(f"source: cannot download {repo_id}: {e.strerror or e}") from None
    folder = Path(folder)
    return ResolvedSource(folder, repo_id, folder.name if folder.parent.name == "snapshots" else revision, False)


def resolve_checkpoint(path_or_repo_id, *, revision: str | None = None, token: str | None = None) -> Path:
    """A local directory as is; otherwise a hub repository id, fetched (or found in the local cache,
    e.g. with ``HF_HUB_OFFLINE=1``) by huggingface_hub."""
    try:
        return resolve_source(os.fspath(path_or_repo_id), revision=revision, token=token).path
    except CheckpointError as exc:  # the resolver names its argument "source"; here it is path_or_repo_id
        message = str(exc)
        raise CheckpointError("path_or_repo_id" + message[len("source"):] if message.startswith("source:")
                              else message) from None
