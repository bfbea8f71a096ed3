"""Keep secrets out of logs and terminal output.

A value is secret when its variable name looks like one (TOKEN, SECRET, PASSWORD, API_KEY, ...)
or the inventory lists the name under `secret_vars`.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_?KEY|CREDENTIAL|AUTH)", re.I)
MASK = "***"


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def secret_values(mapping: Mapping[str, Any], extra_names: Iterable[str] = ()) -> set[str]:
    """Secret values found in a (possibly nested) mapping of variables."""
    names = set(extra_names)
    found: set[str] = set()
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            found |= secret_values(value, names)
        elif value is not None and (is_secret_name(str(key)) or key in names):
            text = str(value)
            if len(text) >= 4:  # masking very short strings would mangle unrelated output
                found.add(text)
    return found


class Redactor:
    def __init__(self, secrets: Iterable[str] = ()):
        # Longest first, so a secret containing another is masked whole.
        self.secrets = sorted(set(secrets), key=len, reverse=True)

    @classmethod
    def for_host(cls, host) -> "Redactor":
        return cls(secret_values(host.vars, host.vars.get("secret_vars") or ()))

    def add(self, values: Iterable[str]) -> None:
        self.secrets = sorted(set(self.secrets) | {v for v in values if v and len(v) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, MASK)
        return text
