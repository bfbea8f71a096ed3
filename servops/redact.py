"""Keep secrets out of logs and terminal output.

A value is secret when its variable name looks like one (TOKEN, SECRET, PASSWORD, API_KEY, ...)
or the inventory lists the name under `secret_vars`.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Mapping

MASK = "***"
_FLAG_VALUE = re.compile(r"--([A-Za-z0-9][A-Za-z0-9_-]*)(?:=|\s+)(?!-)(\S+)")
_NUMBER = re.compile(r"\s*[-+]?[0-9.]+([eE][-+]?[0-9]+)?\s*")
# By the name's words: HF_TOKEN, GITHUB_TOKEN, AWS_SECRET_ACCESS_KEY, OPENAI_API_KEY, DB_PASSWORD,
# AUTH_TOKEN are secrets; TOKENIZERS_PARALLELISM, MAX_TOKENS or SGLANG_DOUBLE_TOKEN_DELAY are not
# (masking "false" everywhere would mangle every log). Others: the inventory's `secret_vars`.
_SECRET_LAST = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "CREDENTIALS", "APIKEY", "PAT"}
_SECRET_ANY = {"SECRET", "PASSWORD", "PASSWD", "CREDENTIALS"}
_KEY_QUALIFIERS = {"API", "ACCESS", "PRIVATE", "SECRET", "AUTH", "SIGNING", "ENCRYPTION"}


def is_secret_name(name: str) -> bool:
    words = [w for w in re.split(r"[^A-Za-z0-9]+", str(name).upper()) if w]
    if not words:
        return False
    if words[-1] in _SECRET_LAST or _SECRET_ANY & set(words):
        return True
    return words[-1] == "KEY" and len(words) > 1 and words[-2] in _KEY_QUALIFIERS


def variant_secrets(variant: Mapping[str, Any], extra_names: Iterable[str] = ()) -> set[str]:
    """A variant's secret values: its env's, and those of flags named like secrets (--api-key)."""
    args = {k.lstrip("-"): v for k, v in (variant.get("server_args") or {}).items() if not isinstance(v, bool)}
    return secret_values(variant.get("env") or {}, extra_names) | secret_values(args)


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


# Every secret any Redactor of this process has seen: whatever servops prints is masked of all of
# them (servops.output), so a verb that forgot to redact (a launch check's argv, a library's
# error text) still prints *** -- files written are redacted by their writers.
_KNOWN: set[str] = set()
_KNOWN_SORTED: list[str] = []


def remember(values: Iterable[str]) -> None:
    global _KNOWN_SORTED
    new = {str(v) for v in values if v and len(str(v)) >= 4} - _KNOWN
    if new:
        _KNOWN.update(new)
        _KNOWN_SORTED = sorted(_KNOWN, key=len, reverse=True)


def mask_known(text: str) -> str:
    for s in _KNOWN_SORTED:
        if s in text:
            text = text.replace(s, MASK)
    return text


class Redactor:
    def __init__(self, secrets: Iterable[str] = ()):
        # Longest first, so a secret containing another is masked whole.
        self.secrets = sorted(set(secrets), key=len, reverse=True)
        remember(self.secrets)

    def learn(self, obj: Any) -> None:
        """Add the values of secret-named keys in what a server reports about itself (sglang's
        /server_info holds api_key, and launch_command holds it again)."""
        if isinstance(obj, Mapping):
            # strings only: a number under a token-ish name (max_..._per_token: 1024) is no secret
            self.add(secret_values({k: v for k, v in obj.items() if isinstance(v, str) and not _NUMBER.fullmatch(v)}))
            for v in obj.values():
                if isinstance(v, (Mapping, list)):
                    self.learn(v)
                elif isinstance(v, str):  # a command line: `--api-key VALUE` / `--api-key=VALUE`
                    self.add(m[2].strip("'\"") for m in _FLAG_VALUE.finditer(v)
                             if is_secret_name(m[1]) and not _NUMBER.fullmatch(m[2]))
        elif isinstance(obj, list):
            for v in obj:
                self.learn(v)

    @classmethod
    def for_host(cls, host) -> "Redactor":
        return cls(secret_values(host.vars, host.vars.get("secret_vars") or ()))

    def add(self, values: Iterable[str]) -> None:
        self.secrets = sorted(set(self.secrets) | {v for v in values if v and len(v) >= 4}, key=len, reverse=True)
        remember(self.secrets)

    def __call__(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, MASK)
        return text


def redact_values(obj: Any, redactor: Callable[[str], str]) -> Any:
    """`obj` (JSON-like) with every string passed through `redactor`: what a file servops writes
    holds (a JSON text masked as a whole misses a secret JSON escaping changed)."""
    if isinstance(obj, str):
        return redactor(obj)
    if isinstance(obj, dict):
        return {k: redact_values(v, redactor) for k, v in obj.items()}
    if isinstance(obj, list):
        if obj and not isinstance(obj[0], (str, dict, list)):
            return obj  # numbers: nothing to mask
        return [redact_values(v, redactor) for v in obj]
    return obj
