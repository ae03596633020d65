"""Rewrite (or with `--check`, verify) the README's option table from `ort_autopatch.config`.

The table sits between `<!-- options:begin -->` and `<!-- options:end -->`; CI runs `--check`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, installed or not

from ort_autopatch.config import markdown_table  # noqa: E402

README = ROOT / "README.md"
BEGIN, END = "<!-- options:begin -->", "<!-- options:end -->"


def rendered(text: str) -> str:
    """`text` with the block between the markers replaced by the current table."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{README}: markers {BEGIN} ... {END} not found")
    return f"{head}{BEGIN}\n{markdown_table()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    args = parser.parse_args()
    text = README.read_text(encoding="utf-8")
    new = rendered(text)
    if args.check:
        if new != text:
            print(f"{README}: option table is stale; run python tools/readme_options.py")
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
