"""Passwords inside URLs, masked wherever hvdtrain prints or stores a value.

``tracking.mlflow.tracking_uri=http://user:pass@host:5000`` works, but hvdtrain copies config
values into config.yaml, every checkpoint, ``--print-config``, the trackers' params and its log
lines; each of those shows ``http://user:***@host:5000`` instead. The password itself belongs in
the environment (MLflow reads ``MLFLOW_TRACKING_USERNAME`` and ``MLFLOW_TRACKING_PASSWORD``), where
no file and no ``ps`` listing shows it. Light on purpose (no torch): config.py uses it.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"
# scheme://user:password@ : the password is what lies between the first ':' after '//' and the '@'.
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):(?P<password>[^@/\s]+)@")


def mask_text(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***`` (the user name stays)."""
    return _USERINFO.sub(lambda match: f"{match.group('head')}:{MASK}@", text)


def mask_values(value: Any) -> Any:
    """A copy of a config mapping (nested dicts, lists) with ``mask_text`` applied to every string."""
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, dict):
        return {key: mask_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask_values(item) for item in value)
    return value


def has_password(uri: str) -> bool:
    """Whether ``uri`` holds a real password (not one masked by ``mask_text``)."""
    return bool(uri) and urlsplit(uri).password not in (None, MASK)


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """``http://user:pass@host:5000/x`` -> (``http://host:5000/x``, user, password), percent-escapes
    decoded (``p%40ss`` is ``p@ss``, as a browser sends it); a URI without a password comes back
    unchanged, with (None, None)."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri, None, None
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=host)), unquote(parts.username or ""), unquote(parts.password)


def without_credentials(uri: str) -> str:
    """``uri`` without its user name and password: the server it names, for comparisons."""
    parts = urlsplit(uri or "")
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
