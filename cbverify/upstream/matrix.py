"""``cbverify matrix``: the upstream checks across transformers (x trl) versions, one cached venv per combination.

For every combination a venv under ``.matrix-venvs/`` (gitignored) gets ``torch==2.13.0`` (from the local wheel
cache), the requested ``transformers`` / ``trl`` (a version, or a local checkout path for a branch under review), the
project's other dependencies at their ``constraints.txt`` versions, and this repository in editable mode with
``--no-deps``. A stamp file records what was installed, so a rerun reuses the
venv. Inside it, ``python -m cbverify.cli upstream --run --json`` runs the default scenarios; the results become a
version x check table (one cell per check and path: the worst label over the scenarios), printed and written as
JSON and Markdown. A combination pip cannot install (e.g. a trl that needs a newer transformers) is a column of
``INSTALL-FAILED`` with pip's last line, never a silent skip.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TORCH_PIN = "torch==2.13.0"
RANK = {"FAIL": 5, "FIXED?": 4, "XFAIL": 3, "PASS": 2, "NOT-APPLICABLE": 1}
SHORT = {"NOT-APPLICABLE": "n/a", "XFAIL": "xfail", "PASS": "pass", "FAIL": "FAIL", "FIXED?": "FIXED?"}


def _spec(package: str, value: str | None) -> str | None:
    """A pip requirement: ``pkg==V``, or a local checkout path as given (made absolute)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else f"{package}=={value}"


def combo_name(transformers: str, trl: str | None) -> str:
    def part(v: str) -> str:
        return "path-" + hashlib.sha1(v.encode()).hexdigest()[:8] if Path(v).expanduser().exists() else v

    return f"transformers-{part(transformers)}" + (f"_trl-{part(trl)}" if trl else "_trl-pinned")


def _pip(python: Path, *args: str, log) -> tuple[bool, str]:
    proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *args], capture_output=True, text=True)
    log.write(f"$ pip install {' '.join(args)}\n{proc.stdout}{proc.stderr}\n")
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return proc.returncode == 0, (lines[-1] if lines else "")


def ensure_venv(venv: Path, transformers: str, trl: str | None, log) -> str | None:
    """Create or reuse the venv; ``None`` when ready, else the install error's last line."""
    wanted = json.dumps({"torch": TORCH_PIN, "transformers": _spec("transformers", transformers),
                         "trl": _spec("trl", trl) or "pinned"}, sort_keys=True)  # fmt: skip
    stamp, python = venv / ".cbverify-stamp", venv / "bin" / "python"
    if stamp.is_file() and stamp.read_text() == wanted and python.exists():
        return None
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    trl_req = _spec("trl", trl) or _pinned_trl()
    constraints = venv / "constraints-except-varied.txt"
    pinned = [ln for ln in _pinned_others() if ln.split("==")[0].lower() in _project_deps()]
    constraints.write_text("".join(ln + "\n" for ln in pinned))
    others = [ln.split("==")[0] for ln in pinned]
    steps = [
        (TORCH_PIN,),
        ("-c", str(constraints), _spec("transformers", transformers), trl_req, *others),
        ("--no-deps", "-e", str(REPO)),
    ]
    for args in steps:
        ok, last = _pip(python, *args, log=log)
        if not ok:
            return f"pip install {' '.join(args)}: {last}"
    stamp.write_text(wanted)
    return None


VARIED = {"torch", "transformers", "trl", "tokenizers"}  # tokenizers: each transformers pins its own range


def _project_deps() -> set[str]:
    """Lower-case names of this project's runtime dependencies (pyproject), the varied ones excluded."""
    import re
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in deps} - VARIED


def _pinned_others() -> list[str]:
    """``constraints.txt`` without the varied packages; only our direct dependencies get pinned (their own
    dependencies, e.g. huggingface_hub, are left to pip so that an older transformers can resolve)."""
    lines = (REPO / "constraints.txt").read_text().splitlines()
    return [ln for ln in lines if "==" in ln and ln.split("==")[0].lower() not in VARIED]


def _pinned_trl() -> str:
    import trl

    return f"trl=={trl.__version__}"


def run_combo(venv: Path, args: argparse.Namespace, out_json: Path, log) -> tuple[dict | None, str]:
    cmd = [str(venv / "bin" / "python"), "-m", "cbverify.cli", "upstream", "--run", "--quiet", "--json", str(out_json)]
    cmd += ["--random-model"] if args.random_model else ["--model", args.model]
    cmd += ["--path", args.path] if args.path else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None, f"check run exceeded {args.timeout} s"
    log.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if not out_json.is_file():
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
        return None, f"check run crashed (rc {proc.returncode}): {tail[0][:200]}"
    return json.loads(out_json.read_text()), f"rc {proc.returncode}"


def table(columns: dict[str, dict | str]) -> tuple[list[str], list[list[str]]]:
    """``columns``: combo -> upstream payload (or an error string). Rows: (check, path), cells: worst label."""
    keys: list[tuple[str, str]] = []
    for payload in columns.values():
        for r in payload["results"] if isinstance(payload, dict) else []:
            if (r["check"], r["path"]) not in keys:
                keys.append((r["check"], r["path"]))
    header = ["check", "path", *columns]
    rows = []
    for check, path in keys:
        row = [check, path]
        for payload in columns.values():
            if not isinstance(payload, dict):
                row.append("INSTALL-FAILED" if payload.startswith("pip") else "ERROR")
                continue
            labels = [r["label"] for r in payload["results"] if (r["check"], r["path"]) == (check, path)]
            worst = max(labels, key=lambda lab: RANK.get(lab.split("(")[0], 0), default="-")
            row.append(SHORT.get(worst.split("(")[0], worst) + (f"({worst.split('(')[1]}" if "(" in worst else ""))
        rows.append(row)
    return header, rows


def render_text(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*["-" * w for w in widths]), *(fmt.format(*r) for r in rows)])


def render_markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
