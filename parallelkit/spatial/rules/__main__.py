"""``python -m parallelkit.spatial.rules [--write FILE]``: the operations table of the rules.

Prints the markdown table generated from the registry, or with ``--write`` puts it in place of
the one between the markers in FILE (docs/parallelism.md); tests/spatial/test_guard.py checks
that the docs hold the table the registry gives.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from parallelkit.spatial.rules import docs_table

BEGIN, END = "<!-- rules table: begin -->", "<!-- rules table: end -->"


def in_docs(text: str) -> str:
    """The table between the markers of ``text``."""
    match = re.search(f"{BEGIN}\n(.*?){END}", text, re.S)
    if match is None:
        raise ValueError(f"no {BEGIN} ... {END} in the file")
    return match.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="replace the table between the markers")
    args = parser.parse_args()
    table = docs_table()
    if args.write is None:
        print(table, end="")
        return
    text = args.write.read_text()
    old = f"{BEGIN}\n{in_docs(text)}{END}"
    args.write.write_text(text.replace(old, f"{BEGIN}\n{table}{END}"))


if __name__ == "__main__":
    main()
