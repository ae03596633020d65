"""Write the README's reliability section from the counts of the last reliability run.

    python benchmarks/render_reliability.py [results.json]

`nox -s soak` runs tests/reliability (the soak scenarios included) with
ORT_AUTOPATCH_RELIABILITY_RESULTS set, which makes tests/reliability/conftest.py write the counts
per scenario group, then calls this script: the README's numbers come from a run, not a hand.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "reliability.json"
README = ROOT / "README.md"
START, END = "<!-- reliability:start -->", "<!-- reliability:end -->"

TITLES = {
    "faults": "faults injected (exporter, gradient builder, session, ORT forward/backward, "
    "KeyboardInterrupt, cache folder)",
    "memory": "memory and long runs (sessions freed with the model, cache bound, soak)",
    "inputs": "bad and unusual inputs",
    "concurrency": "threads",
    "safety": "configuration and cache safety",
}


def render(counts: dict[str, dict[str, int]]) -> str:
    tried = sum(c["tried"] for c in counts.values())
    survived = sum(c["survived"] for c in counts.values())
    lines = [
        START,
        f"{survived} of {tried} scenarios survived in the last `nox -s soak` run "
        "(`benchmarks/results/reliability.json`):",
        "",
        "| scenarios | tried | survived |",
        "|---|---|---|",
    ]
    for group, count in counts.items():
        lines.append(f"| {TITLES.get(group, group)} | {count['tried']} | {count['survived']} |")
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS
    counts = json.loads(source.read_text())
    text = README.read_text()
    block = render(counts)
    if START in text:
        text = re.sub(re.escape(START) + ".*?" + re.escape(END), block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n## Reliability\n\n" + block + "\n"
    README.write_text(text)
    print(block)


if __name__ == "__main__":
    main()
