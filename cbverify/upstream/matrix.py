"""``cbverify matrix``: cached venvs, one per transformers (x trl) combination, and the list of releases to cover.

Every combination's venv under ``.matrix-venvs/`` (gitignored) gets the requested ``transformers`` / ``trl`` (a
version, or a local checkout path for a branch under review), the project's other dependencies at their
``constraints.txt`` versions, and this repository in editable mode with ``--no-deps``. ``torch==2.13.0`` is installed
once, in ``.matrix-venvs/_torch`` (from the local wheel cache), and shared by every venv through a ``.pth`` file:
~50 s and 900 MB saved per version. Then :data:`PROBE` imports what cbverify drives from TRL: a release that imports
a module it does not declare (trl 1.0 to 1.13 import ``requests`` at import time, which nothing in the pinned stack
installs any more) gets that module installed under the constraints, one at a time, at most :data:`MAX_ADDED`, each
printed and logged. A stamp file records what was asked for and what was added, so a rerun reuses the venv.
:func:`minor_releases` lists the newest patch of every minor release of a package from a floor (``--all-minors 5.8``
for transformers, ``--all-trl-minors 1.0``), read from the package index. What runs inside each venv is
:mod:`cbverify.upstream.matrix_checks`.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TORCH_PIN = "torch==2.13.0"
PROBE = "from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer"
MAX_ADDED = 3  # modules a release may import without declaring them before its venv is an install error


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


def ensure_base(venv_dir: Path, log) -> Path | str:
    """The shared torch venv's ``site-packages`` (built once), or pip's error."""
    base = venv_dir / "_torch"
    site = base / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    stamp = base / ".cbverify-stamp"
    if not (stamp.is_file() and stamp.read_text() == TORCH_PIN):
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(base)], check=True)
        ok, last = _pip(base / "bin" / "python", TORCH_PIN, log=log)
        if not ok:
            return f"pip install {TORCH_PIN}: {last}"
        stamp.write_text(TORCH_PIN)
    return site


def ensure_venv(venv: Path, transformers: str, trl: str | None, log) -> str | None:
    """Create or reuse the venv; ``None`` when ready, else the install error's last line."""
    wanted = {"torch": TORCH_PIN, "transformers": _spec("transformers", transformers),
              "trl": _spec("trl", trl) or "pinned"}  # fmt: skip
    stamp, python = venv / ".cbverify-stamp", venv / "bin" / "python"
    if stamp.is_file() and python.exists() and _stamped(stamp) == wanted:
        return None
    base = ensure_base(venv.parent, log)
    if isinstance(base, str):
        return base
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    site = venv / "lib" / base.parent.name / "site-packages"
    (site / "cbverify-shared-torch.pth").write_text(f"{base}\n")  # appended after the venv's own site-packages
    trl_req = _spec("trl", trl) or _pinned_trl()
    constraints = venv / "constraints-except-varied.txt"
    pinned = [ln for ln in _pinned_others() if ln.split("==")[0].lower() in _project_deps()]
    constraints.write_text("".join(ln + "\n" for ln in pinned))
    others = [ln.split("==")[0] for ln in pinned]
    steps = [
        ("-c", str(constraints), TORCH_PIN, _spec("transformers", transformers), trl_req, *others),
        ("--no-deps", "-e", str(REPO)),
    ]
    for args in steps:
        ok, last = _pip(python, *args, log=log)
        if not ok:
            return f"pip install {' '.join(args)}: {last}"
    added: list[str] = []
    while (failure := _probe(python, log)) is not None:
        module, last = failure
        if module is None or len(added) == MAX_ADDED:
            return f"{PROBE}: {last}" + (f" (after adding {', '.join(added)})" if added else "")
        ok, pip_last = _pip(python, "-c", str(constraints), module, log=log)
        if not ok:
            return f"{PROBE} lacks module {module!r}; pip install {module}: {pip_last}"
        added.append(module)
        print(f"[{venv.name}] trl imports {module!r} without declaring it: installed it", flush=True)
        log.write(f"added {module!r}: trl imports it without declaring it\n")
    stamp.write_text(json.dumps({**wanted, "added": added}, sort_keys=True))
    return None


def _stamped(stamp: Path) -> dict:
    """What a venv's stamp says was asked for (the modules added for it left out)."""
    return {k: v for k, v in json.loads(stamp.read_text()).items() if k != "added"}


def added_modules(venv: Path) -> list[str]:
    """The modules :func:`ensure_venv` installed because the venv's TRL imports them without declaring them."""
    return json.loads((venv / ".cbverify-stamp").read_text()).get("added", [])


def _probe(python: Path, log) -> tuple[str | None, str] | None:
    """``None`` when :data:`PROBE` imports, else ``(the top-level module it lacks or None, the error's last line)``."""
    proc = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True)
    log.write(f"$ python -c {PROBE!r}\n{proc.stderr}\n")
    if proc.returncode == 0:
        return None
    missing = re.search(r"ModuleNotFoundError: No module named '(\w+)", proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()] or ["no output"]
    return (missing.group(1) if missing else None), lines[-1]


def minor_releases(package: str, since: str) -> list[str]:
    """The newest final patch release of every ``package`` minor version from ``since`` on (later majors included:
    trl 0.29 is followed by 1.0), oldest first, as the package index lists them (``pip index versions``); an
    unreachable index is an error."""
    from packaging.version import Version

    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package],
                          capture_output=True, text=True)  # fmt: skip
    listed = [ln for ln in proc.stdout.splitlines() if ln.startswith("Available versions:")]
    if proc.returncode or not listed:
        raise RuntimeError(f"cannot list {package} releases: {(proc.stderr or proc.stdout).strip()[-200:]}")
    floor = Version(since)
    newest: dict[tuple[int, int], Version] = {}
    for v in (Version(x.strip()) for x in listed[0].split(":", 1)[1].split(",")):
        if v.is_prerelease or v.is_devrelease or (v.major, v.minor) < (floor.major, floor.minor):
            continue
        newest[(v.major, v.minor)] = max(v, newest.get((v.major, v.minor), v))
    return [str(newest[k]) for k in sorted(newest)]


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
