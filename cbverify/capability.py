"""Verdicts side by side across CPU kernels: ``python -m cbverify.capability A.json B.json ...``.

Each file is a report of the same command (``cbverify verify --json`` or ``cbverify upstream --run --json``) run under
another ``ATEN_CPU_CAPABILITY``. Prints one row per verdict (an engine, or a scenario's check) with its label in each
report, marks the rows that differ, and exits 1 if any does: a verdict that changes with the kernels torch dispatches
to depends on the machine. ``make cpu-capabilities`` runs verify and upstream (1 and 2 processes) under the native and
the portable kernels and compares them with this.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def verdicts(report: dict) -> tuple[str, dict[str, str]]:
    """``(capability, {verdict key: label})`` of a verify or upstream report."""
    if "engines" in report:  # cbverify verify
        return report["environment"].get("cpu capability", "?"), {r["engine"]: r["status"] for r in report["engines"]}
    labels = {f"{r['scenario']} :: {r['check']}": r["label"].split("(")[0] for r in report["results"]}
    labels |= {f"(vacuous) {check}": "VACUOUS" for check in report.get("vacuous", [])}
    return report.get("cpu_capability", "?"), labels


def side_by_side(paths: list[Path]) -> tuple[str, int]:
    """The table and the number of verdicts that differ between the reports."""
    columns = [verdicts(json.loads(p.read_text())) for p in paths]
    keys = list(dict.fromkeys(k for _, labels in columns for k in labels))
    width = min(110, max(len(k) for k in keys))
    lines = [f"   {'verdict':<{width}}  " + "  ".join(f"{cap:<14}" for cap, _ in columns)]
    differ = 0
    for key in keys:
        labels = [labels.get(key, "-") for _, labels in columns]
        same = len(set(labels)) == 1
        differ += not same
        lines.append(f"{'  ' if same else '!!'} {key[:width]:<{width}}  " + "  ".join(f"{x:<14}" for x in labels))
    lines.append(f"{len(keys)} verdicts, {differ} differ between " + " / ".join(cap for cap, _ in columns))
    return "\n".join(lines), differ


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m cbverify.capability REPORT.json REPORT.json [...]", file=sys.stderr)
        return 2
    paths = [Path(a) for a in argv]
    if missing := [str(p) for p in paths if not p.is_file()]:
        print(f"no such report: {', '.join(missing)}", file=sys.stderr)
        return 2
    table, differ = side_by_side(paths)
    print(table)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
