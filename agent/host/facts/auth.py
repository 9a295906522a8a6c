"""The issuer keys the config names (``auth.issuer_keys``), as the doctor reads them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from viiwork.agent.auth.keyset import IssuerKeyError, KeySet
from viiwork.agent.config.schema import Config


@dataclass(frozen=True, slots=True)
class IssuerKeysFact:
    """``auth.issuer_keys`` read with the agent's own loader (``KeySet.from_path``): ``kids``
    of the keys it holds, or ``error`` (the loader's message). ``permission``: the file exists
    but this user may not read it (the doctor is not root), so nothing is known."""

    path: str
    kids: tuple[str, ...] = ()
    error: str | None = None
    permission: bool = False


def read_issuer_keys(config: Config) -> IssuerKeysFact | None:
    """The issuer keys of ``config``; None when client keys are off (``auth.mode = "none"``)."""
    if config.auth.mode != "keys":
        return None
    path = Path(config.auth.issuer_keys)
    try:
        keys = KeySet.from_path(path)
    except IssuerKeyError as exc:
        denied = path.exists() and not os.access(path, os.R_OK)
        return IssuerKeysFact(str(path), error=str(exc), permission=denied)
    return IssuerKeysFact(str(path), kids=tuple(sorted(keys.keys)))
