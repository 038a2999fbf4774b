"""The Hugging Face hub: resolving a branch or tag to a commit, offline mode, and fetching a model's config.json alone."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..core.errors import HubUnreachable, InputError


def network_errors() -> tuple[type[BaseException], ...]:
    """What the hub client raises for network failures (its HTTP library's base error)."""
    from huggingface_hub import errors

    return (OSError, getattr(errors, "HTTPError", OSError))


def hub_offline(offline: bool | None = None) -> bool:
    """Whether to ask no hub: `offline` as given, or (None) as HF_HUB_OFFLINE says."""
    if offline is not None:
        return offline
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def resolve_hub_revision(repo_id: str, revision: str | None, *, offline: bool | None = None) -> str:
    """Resolve a branch or tag to its commit sha: from the hub, or from the local cache offline
    (`offline` None: as HF_HUB_OFFLINE says)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    network = network_errors()
    rev = revision or "main"
    if re.fullmatch(r"[0-9a-f]{40}", rev):
        return rev
    try:
        if hub_offline(offline):
            snap = snapshot_download(
                repo_id, revision=rev, local_files_only=True, allow_patterns=["config.json"]
            )
            return Path(snap).name
        sha = HfApi().model_info(repo_id, revision=rev).sha
    except RepositoryNotFoundError:
        raise InputError(
            f"hub repo {repo_id!r} not found (or private): check the id or log in with `hf auth login`"
        ) from None
    except RevisionNotFoundError:
        raise InputError(
            f"revision {rev!r} not found in {repo_id}: pass an existing branch, tag or commit sha"
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline is None else "the hub is not asked"
        raise InputError(
            f"{repo_id}@{rev} is not in the local HF cache and {why}: fetch it once online, or pass a local directory"
        ) from None
    except HFValidationError as exc:
        raise InputError(f"{repo_id!r} is not a valid hub repo id ({exc}): use org/name") from None
    except network as exc:
        raise HubUnreachable(
            f"cannot reach the hub for {repo_id} ({exc}); set HF_HUB_OFFLINE=1 to use the local cache"
        ) from None
    if not sha:
        raise InputError(
            f"the hub returned no commit for {repo_id}@{rev}: pass a commit sha with --revision"
        )
    return sha


def config_dir(repo_id: str, sha: str, *, offline: bool | None = None) -> Path:
    """The folder of a hub model's config.json at `sha`, downloaded alone (no weights)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        path = hf_hub_download(
            repo_id, "config.json", revision=sha, local_files_only=hub_offline(offline)
        )
    except EntryNotFoundError:
        raise InputError(
            f"{repo_id}@{sha[:12]} has no config.json: it is not a transformers model"
        ) from None
    except network_errors() as exc:
        raise InputError(
            f"cannot fetch config.json of {repo_id} ({exc}); set HF_HUB_OFFLINE=1 to use the cache"
        ) from None
    return Path(path).parent
