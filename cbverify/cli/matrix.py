"""``cbverify matrix``: the upstream checks across transformers (x trl) versions (see ``cbverify.upstream.matrix``)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cbverify.upstream.matrix import REPO, combo_name, ensure_venv, render_markdown, render_text, run_combo, table


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transformers", nargs="+", required=True, help="transformers versions or checkout paths")
    parser.add_argument("--trl", nargs="+", default=[None], help="trl versions or checkout paths (default: pinned)")
    parser.add_argument("--venv-dir", type=Path, default=REPO / ".matrix-venvs", help="where the cached venvs live")
    parser.add_argument(
        "--out", type=Path, default=REPO / ".matrix-venvs" / "results", help="folder for JSON/Markdown/log output"
    )
    parser.add_argument("--model", default="tiny-llama-arith", help="bundled model name or local checkpoint path")
    parser.add_argument(
        "--random-model", action="store_true", help="--model's architecture with seeded random weights"
    )
    parser.add_argument("--path", choices=("generate", "cb", "rollout_func"), help="only scenarios on this path")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds allowed per combination's check run")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    combos = [(t, r) for t in args.transformers for r in args.trl]
    args.venv_dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    columns: dict[str, dict | str] = {}
    timings: dict[str, float] = {}
    ok = True
    with (args.out / "matrix.log").open("w") as log:
        for transformers, trl in tqdm(combos, desc="matrix", unit="combo"):
            name = combo_name(transformers, trl)
            start = time.perf_counter()
            tqdm.write(f"[{name}] preparing venv")
            error = ensure_venv(args.venv_dir / name, transformers, trl, log)
            if error is None:
                tqdm.write(f"[{name}] running the upstream checks")
                payload, note = run_combo(args.venv_dir / name, args, args.out / f"{name}.json", log)
                error = None if payload is not None else note
            columns[name] = payload if error is None else error
            timings[name] = round(time.perf_counter() - start, 1)
            if error:
                ok = False
                tqdm.write(f"[{name}] {error}")
            else:
                ok &= all(r["ok"] for r in payload["results"])
                tqdm.write(f"[{name}] done in {timings[name]} s ({note})")
    header, rows = table(columns)
    versions = {n: p["versions"] if isinstance(p, dict) else p for n, p in columns.items()}
    (args.out / "matrix.json").write_text(json.dumps({"versions": versions, "seconds": timings, "header": header,
                                                      "rows": rows}, indent=2))  # fmt: skip
    md = render_markdown(header, rows) + "\n\n" + "\n".join(f"- `{n}`: {s} s" for n, s in timings.items())
    (args.out / "matrix.md").write_text(md + "\n")
    print(render_text(header, rows))
    print("\n" + "\n".join(f"{n}: {v}  ({timings[n]} s)" for n, v in versions.items()))
    print(f"wrote {args.out / 'matrix.json'} and {args.out / 'matrix.md'}")
    return 0 if ok else 1
