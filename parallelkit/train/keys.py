"""Every key of the training config with its default, read from the schema's dataclasses.

What ``parallelkit train --help`` lists, and what a test holds docs/training.md's key table
to, so neither can fall behind the schema (:mod:`parallelkit.train.schema`).
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

from parallelkit.train.schema import Config


def defaults(node: Any = None, prefix: str = "") -> dict[str, Any]:
    """``{"section.key": default}`` for every leaf of :class:`Config`, in the schema's order."""
    node = Config() if node is None else node
    out: dict[str, Any] = {}
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            out |= defaults(value, f"{prefix}{f.name}.")
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def key_table() -> str:
    """The keys and their defaults, a section per line group, for ``--help``."""
    lines = ["every key, with its default (docs/training.md says what each does):"]
    section = ""
    for key, value in defaults().items():
        if key.split(".")[0] != section:
            section = key.split(".")[0]
            lines.append("")
        shown = "(by train.task)" if "pk.default:" in str(value) else _shown(value)
        lines.append(f"  {key} = {shown}")
    return "\n".join(lines)


def _shown(value: Any) -> str:
    """A default as it is written on the command line (YAML's spelling)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, str):
        return value or "''"
    return str(list(value) if isinstance(value, tuple) else value)
