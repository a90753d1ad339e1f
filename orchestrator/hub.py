"""Models by name: `--model ORG/NAME` from the local Hugging Face cache, offline.

The cache is the one `huggingface-cli download` and transformers fill: `$HF_HUB_CACHE`, else
`$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`. A
repository `ORG/NAME` lives in `models--ORG--NAME/`; `refs/<revision>` holds the commit of a
branch or tag and `snapshots/<commit>/` the files (links into `blobs/`). Nothing here touches
the network: a model that is not in the cache is an error that says where it looked and how
to fetch it, never a download at start-up.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

# ORG/NAME as the Hub spells repository ids (letters, digits, '-', '_', '.'), optional @rev.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubModelError(ValueError):
    """A model name that is not in the local cache; the message says where it looked."""


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The hub cache directory, honouring HF_HUB_CACHE, HF_HOME and XDG_CACHE_HOME."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else (
        Path.home() / ".cache")
    return base / "huggingface" / "hub"


def looks_like_repo_id(text: str) -> bool:
    """ORG/NAME (optionally @revision): a name to look up when no such directory exists."""
    return bool(_REPO_ID.match(text)) and not text.startswith((".", "~"))


def split_revision(repo_id: str) -> tuple[str, str]:
    """`ORG/NAME@rev` -> (ORG/NAME, rev); no @ -> revision `main`."""
    name, _, rev = repo_id.partition("@")
    return name, rev or "main"


def resolve_repo_id(repo_id: str, env: Mapping[str, str] | None = None) -> Path:
    """The snapshot directory of `ORG/NAME[@rev]` in the local cache; HubModelError if absent.

    The revision is a branch or tag with a `refs/` entry, or a commit; without `refs/main` a
    cache holding exactly one snapshot is taken (caches copied between machines often lack
    refs/).
    """
    name, rev = split_revision(repo_id)
    cache = hub_cache_dir(env)
    repo_dir = cache / ("models--" + name.replace("/", "--"))
    revision = "" if rev == "main" else f" --revision {rev}"
    fetch = f"`huggingface-cli download {name}{revision}` (or pass a model directory)"
    if not repo_dir.is_dir():
        raise HubModelError(f"model {repo_id!r}: no such directory, and not in the Hugging Face "
                            f"cache (looked for {repo_dir}; HF_HOME / HF_HUB_CACHE set the "
                            f"cache); fetch it with {fetch}")
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / rev
    if ref.is_file():
        commit = ref.read_text().strip()
    elif _COMMIT.match(rev):
        commit = rev
    else:
        have = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
        if rev != "main" or len(have) != 1:
            raise HubModelError(f"model {repo_id!r}: {repo_dir} has no refs/{rev} and "
                                f"{len(have)} snapshots ({', '.join(have[:3]) or 'none'}); name "
                                f"one as {name}@COMMIT or re-fetch it with {fetch}")
        commit = have[0]
    snapshot = snapshots / commit
    if not (snapshot / "config.json").is_file():
        raise HubModelError(f"model {repo_id!r}: {snapshot} has no config.json (an incomplete "
                            f"download?); re-fetch it with {fetch}")
    return snapshot
