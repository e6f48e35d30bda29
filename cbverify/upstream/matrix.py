"""``cbverify matrix``: cached venvs, one per transformers (x trl) combination, and the list of releases to cover.

Every combination's venv (under the checkout's ``.matrix-venvs/``, or the user cache of an installed cbverify:
:func:`cbverify.data.workdir`) gets the requested ``transformers`` / ``trl`` (a version, or a local checkout path for
a branch under review), the project's other dependencies at their ``constraints.txt`` versions, and this cbverify
without its dependencies: the checkout in editable mode, or the installed packages linked in through a ``.pth`` file.
Installs go through :mod:`cbverify.install`: with uv, every venv gets ``torch==2.13.0`` hard-linked from uv's cache;
with pip, torch is installed once, in ``_torch`` beside the venvs (from the local wheel cache), and shared by every
venv through a ``.pth`` file (~50 s and 900 MB saved per version). Then :data:`PROBE` imports what cbverify drives
from TRL: a release that imports a module it does not declare (trl 1.0 to 1.13 import ``requests`` at import time,
which nothing in the pinned stack installs any more) gets that module installed under the constraints, one at a
time, at most :data:`MAX_ADDED`, each printed and logged. A stamp file records what was asked for and what was
added, so a rerun reuses the venv. :func:`minor_releases` lists the newest patch of every minor release of a package
from a floor (``--all-minors 5.8`` for transformers, ``--all-trl-minors 1.0``), read from the package index. What
runs inside each venv is :mod:`cbverify.upstream.matrix_checks`.

A trl release that cannot import ``GRPOTrainer`` beside transformers 5 (before
:data:`cbverify.upstream.trl_compat.TRANSFORMERS_5_FROM`, 0.29; the reason is in that module) is paired with the
newest transformers 4.x its own metadata allows instead (:func:`paired_transformers`: the ``Requires-Dist`` of its
wheel, downloaded without dependencies, against the index's transformers releases), whichever transformers 5 was
asked for beside it; the combination's name and stamp say the transformers it was built with. Beside transformers 4.x
``datasets`` is left to the resolver: the pinned datasets 5.2 needs ``huggingface_hub>=1.31``, which transformers 4.x
(``huggingface_hub<1.0``) refuses.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

from cbverify import data, install

REPO = data.checkout()  # None for an installed cbverify
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
    """The venv's folder name: the transformers it is built with (:func:`paired_transformers`) and the trl."""

    def part(v: str) -> str:
        return "path-" + hashlib.sha1(v.encode()).hexdigest()[:8] if Path(v).expanduser().exists() else v

    try:
        transformers = paired_transformers(transformers, trl)
    except RuntimeError:  # the index is unreachable: ensure_venv reports it as the venv's error
        pass
    return f"transformers-{part(transformers)}" + (f"_trl-{part(trl)}" if trl else "_trl-pinned")


def _version(value: str | None):
    """``value`` as a ``Version``, or ``None`` for a checkout path, nothing, or anything else that is not one."""
    from packaging.version import InvalidVersion, Version

    if value is None or Path(value).expanduser().exists():
        return None
    try:
        return Version(value)
    except InvalidVersion:
        return None


@functools.cache
def index_versions(package: str) -> tuple[str, ...]:
    """Every release of ``package`` the package index lists (``pip index versions``), newest first; an unreachable
    index is a ``RuntimeError``."""
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package],
                          capture_output=True, text=True)  # fmt: skip
    listed = [ln for ln in proc.stdout.splitlines() if ln.startswith("Available versions:")]
    if proc.returncode or not listed:
        raise RuntimeError(f"cannot list {package} releases: {(proc.stderr or proc.stdout).strip()[-200:]}")
    return tuple(x.strip() for x in listed[0].split(":", 1)[1].split(","))


@functools.cache
def requires(package: str, version: str, dependency: str):
    """The ``SpecifierSet`` that release ``version`` of ``package`` puts on ``dependency`` (its wheel's
    ``Requires-Dist`` lines without an extra, the wheel downloaded without dependencies into the venv folder's
    ``_metadata``); a download that fails is a ``RuntimeError``."""
    import zipfile

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    folder = data.workdir("matrix-venvs") / "_metadata"
    folder.mkdir(parents=True, exist_ok=True)
    wheels = sorted(folder.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest",
               str(folder), f"{package}=={version}"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(folder.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
        if proc.returncode or not wheels:
            raise RuntimeError(f"cannot download {package}=={version} to read its metadata: "
                               f"{(proc.stderr or proc.stdout).strip()[-200:]}")  # fmt: skip
    with zipfile.ZipFile(wheels[0]) as wheel:
        metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = wheel.read(metadata).decode().splitlines()
    spec = SpecifierSet()
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.name.lower() == dependency.lower() and (req.marker is None or req.marker.evaluate({"extra": ""})):
                spec &= req.specifier
    return spec


def paired_transformers(transformers: str, trl: str | None) -> str:
    """The transformers a combination is built with: ``transformers``, unless ``trl`` is a release before
    :data:`~cbverify.upstream.trl_compat.TRANSFORMERS_5_FROM` (its ``GRPOTrainer`` cannot import beside transformers
    5) and ``transformers`` is 5 or later: then the newest final transformers 4.x that the trl release's metadata
    allows (a ``RuntimeError`` when the index cannot say)."""
    from packaging.version import Version

    from cbverify.upstream.trl_compat import TRANSFORMERS_5_FROM

    asked, release = _version(transformers), _version(trl)
    if asked is None or release is None or asked.major < 5 or release >= Version(TRANSFORMERS_5_FROM):
        return transformers
    allowed = requires("trl", trl, "transformers")
    candidates = [v for v in map(Version, index_versions("transformers"))
                  if v.major < 5 and not (v.is_prerelease or v.is_devrelease) and v in allowed]  # fmt: skip
    if not candidates:
        raise RuntimeError(f"trl {trl} allows transformers {allowed or 'any'}, and the index lists no final 4.x in it")
    return str(max(candidates))


def _pip(python: Path, *args: str, log) -> tuple[bool, str]:
    """``pip install args`` into ``python``'s venv with the chosen installer (:mod:`cbverify.install`), logged."""
    proc = install.run(python, "install", *args)
    log.write(f"$ {install.installer()} pip install {' '.join(args)}\n{proc.stdout}{proc.stderr}\n")
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return proc.returncode == 0, (lines[-1] if lines else "")


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def ensure_base(venv_dir: Path, log) -> Path | str | None:
    """With pip: the shared torch venv's ``site-packages`` (built once), or pip's error. With uv, ``None``: each venv
    installs torch itself, from uv's cache."""
    if install.installer() == "uv":
        return None
    base = venv_dir / "_torch"
    stamp = base / ".cbverify-stamp"
    if not (stamp.is_file() and stamp.read_text() == TORCH_PIN):
        ok, last = _pip(install.create_venv(base), TORCH_PIN, log=log)
        if not ok:
            return f"pip install {TORCH_PIN}: {last}"
        stamp.write_text(TORCH_PIN)
    return _site_packages(base)


def _add_cbverify(python: Path, site: Path, log) -> tuple[bool, str]:
    """This cbverify into the venv without its dependencies: the checkout in editable mode, or (installed) its import
    packages linked into a folder that a ``.pth`` file puts on the venv's path."""
    if REPO is not None:
        return _pip(python, "--no-deps", "-e", str(REPO), log=log)
    (site / "cbverify-packages.pth").write_text(f"{data.import_path()}\n")
    log.write(f"cbverify's packages from {data.import_path()} (a .pth file)\n")
    return True, ""


def ensure_venv(venv: Path, transformers: str, trl: str | None, log) -> str | None:
    """Create or reuse the venv; ``None`` when ready, else the install error's last line."""
    try:
        paired = paired_transformers(transformers, trl)
    except RuntimeError as err:
        return str(err)
    if paired != transformers:
        print(f"[{venv.name}] trl {trl} cannot import GRPOTrainer beside transformers {transformers}: built with "
              f"transformers {paired}, the newest 4.x its metadata allows", flush=True)  # fmt: skip
        log.write(f"transformers {transformers} asked; trl {trl} needs 4.x: transformers {paired}\n")
        transformers = paired
    wanted = {"torch": TORCH_PIN, "transformers": _spec("transformers", transformers),
              "trl": _spec("trl", trl) or "pinned"}  # fmt: skip
    stamp, python = venv / ".cbverify-stamp", venv / "bin" / "python"
    if stamp.is_file() and python.exists() and _stamped(stamp) == wanted:
        return None
    base = ensure_base(venv.parent, log)
    if isinstance(base, str):
        return base
    install.create_venv(venv)
    site = _site_packages(venv)
    if base is not None:
        (site / "cbverify-shared-torch.pth").write_text(f"{base}\n")  # appended after the venv's own site-packages
    trl_req = _spec("trl", trl) or _pinned_trl()
    constraints = venv / "constraints-except-varied.txt"
    unpinned = UNPINNED_BESIDE_4 if (_version(transformers) or _version("5")).major < 5 else set()
    deps = [ln for ln in _pinned_others() if ln.split("==")[0].lower() in _project_deps()]
    constraints.write_text("".join(ln + "\n" for ln in deps if ln.split("==")[0].lower() not in unpinned))
    others = [ln.split("==")[0] for ln in deps]
    args = ("-c", str(constraints), TORCH_PIN, _spec("transformers", transformers), trl_req, *others)
    ok, last = _pip(python, *args, log=log)
    if not ok:
        return f"pip install {' '.join(args)}: {last}"
    ok, last = _add_cbverify(python, site, log)
    if not ok:
        return f"cbverify itself: {last}"
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

    floor = Version(since)
    newest: dict[tuple[int, int], Version] = {}
    for v in map(Version, index_versions(package)):
        if v.is_prerelease or v.is_devrelease or (v.major, v.minor) < (floor.major, floor.minor):
            continue
        newest[(v.major, v.minor)] = max(v, newest.get((v.major, v.minor), v))
    return [str(newest[k]) for k in sorted(newest)]


VARIED = {"torch", "transformers", "trl", "tokenizers"}  # tokenizers: each transformers pins its own range
# left to the resolver beside transformers 4.x: datasets 5.2 (pinned) needs huggingface_hub>=1.31, 4.x wants <1.0
UNPINNED_BESIDE_4 = {"datasets"}


def _project_deps() -> set[str]:
    """Lower-case names of this project's runtime dependencies (its installed metadata, else the checkout's
    pyproject), the varied ones and the extras' excluded."""
    from importlib import metadata

    try:
        deps = [d for d in metadata.requires("cbverify") or [] if "extra ==" not in d]
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
        import tomllib

        deps = tomllib.loads((data.needs_checkout("reading pyproject.toml") / "pyproject.toml").read_text())[
            "project"]["dependencies"]  # fmt: skip
    return {re.split(r"[<>=!~\[ ;(]", d, maxsplit=1)[0].strip().lower() for d in deps} - VARIED


def _pinned_others() -> list[str]:
    """``constraints.txt`` without the varied packages; only our direct dependencies get pinned (their own
    dependencies, e.g. huggingface_hub, are left to pip so that an older transformers can resolve)."""
    lines = data.path("constraints.txt").read_text().splitlines()
    return [ln for ln in lines if "==" in ln and ln.split("==")[0].lower() not in VARIED]


def _pinned_trl() -> str:
    import trl

    return f"trl=={trl.__version__}"
