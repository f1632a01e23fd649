"""docs/config.md's key table, written from the declarations (maxlm/config/*_keys.py): each key's
name, type, default and description, in declaration order. A key declared with the doc `SAME`
shares the row of the key declared just before it.

    python -m maxlm.config.reference     # rewrites the table in docs/config.md

tests/test_config_schema.py fails when docs/config.md's table is not what this writes.
"""

from __future__ import annotations

import pathlib

from maxlm.config import run_keys
from maxlm.config.schema import SAME, Key

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config.md"
START = "<!-- the key table: written by `python -m maxlm.config.reference` from maxlm/config/*_keys.py -->"
END = "<!-- end of the key table -->"


def shown(k: Key) -> str:
    """A default as the table shows it."""
    if k.shown is not None:
        return k.shown
    value = k.default
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if not isinstance(value, tuple) or value else "()"


def table() -> str:
    rows: list[list] = []  # [names, types, defaults, doc]
    for name, k in run_keys.RUN.keys().items():
        default = k.shown if k.shown is not None else f"`{shown(k)}`"
        if k.doc == SAME and rows:
            rows[-1][0].append(name)
            rows[-1][1] += [k.type.__name__] if k.type.__name__ not in rows[-1][1] else []
            rows[-1][2].append(default)
        else:
            rows.append([[name], [k.type.__name__], [default], k.doc])
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for names, kinds, defaults, doc in rows:
        lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {', '.join(kinds)} | {', '.join(defaults)} | {doc} |")
    return "\n".join([START, *lines, END])


def current() -> str:
    """docs/config.md's table as it stands."""
    text = DOC.read_text()
    return text[text.index(START): text.index(END) + len(END)]


def write() -> None:
    text = DOC.read_text()
    start, end = text.index(START), text.index(END) + len(END)
    DOC.write_text(text[:start] + table() + text[end:])


if __name__ == "__main__":
    write()
