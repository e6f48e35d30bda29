"""Where the data the commands read lives: the bundled golden records, the example recipe and prompts, and the
constraints files that environments are built from.

Installed from a wheel or an sdist, the package carries copies under ``cbverify/_data`` (the build puts them there,
see ``setup.py``), found through :mod:`importlib.resources`. Run from a checkout (an editable install, or the
repository on ``PYTHONPATH``), they are read where the repository keeps them. The bundled checkpoints are
``reference.models``' concern (the oracle's loader) and follow the same rule under ``reference/_models``.
"""

from __future__ import annotations

import hashlib
import os
from importlib.resources import files
from pathlib import Path

# name -> where the repository keeps it (the wheel's copy is cbverify/_data/<name>)
SOURCES = {
    "records": "golden/records",
    "examples": "examples",
    "constraints.txt": "constraints.txt",
    "constraints-vllm.txt": "constraints-vllm.txt",
}
PACKAGES = ("cbverify", "reference", "cb_impl")  # the import packages the distribution installs


def checkout() -> Path | None:
    """The repository this package runs from, or ``None`` when it is installed (no checkout around it)."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "golden").is_dir() else None


def path(name: str) -> Path:
    """The bundled file or folder ``name`` (a key of :data:`SOURCES`)."""
    if name not in SOURCES:
        raise KeyError(f"no bundled data {name!r}; known: {', '.join(SOURCES)}")
    installed = Path(str(files("cbverify") / "_data" / name))
    if installed.exists():
        return installed
    root = checkout()
    if root is not None and (root / SOURCES[name]).exists():
        return root / SOURCES[name]
    raise FileNotFoundError(f"bundled data {name!r} is missing: neither {installed} (an installed cbverify) nor a "
                            "checkout's " + SOURCES[name] + " exists; reinstall cbverify")  # fmt: skip


def needs_checkout(what: str) -> Path:
    """The repository root, or a one-line error saying that ``what`` needs a clone of cbverify."""
    root = checkout()
    if root is None:
        raise RuntimeError(f"{what} needs a checkout of the cbverify repository (git clone), not an installed package")
    return root


def site_root() -> Path:
    """The directory holding the import packages this process runs: a checkout, or the site-packages they are
    installed in."""
    return Path(__file__).resolve().parents[1]


def import_path() -> Path:
    """A folder holding cbverify's import packages and nothing else: what a process of another venv (an engine's
    environment, a matrix combination) puts on its path to run this same code without this venv's other packages.
    The checkout itself, or for an installed cbverify a folder of links to its packages in the user cache."""
    root = checkout()
    if root is not None:
        return root
    site = site_root()
    linked = workdir("packages") / hashlib.sha256(str(site).encode()).hexdigest()[:12]
    linked.mkdir(parents=True, exist_ok=True)
    for package in PACKAGES:
        link = linked / package
        if not (link.is_symlink() and link.resolve() == (site / package).resolve()):
            link.unlink(missing_ok=True)
            link.symlink_to(site / package, target_is_directory=True)
    return linked


def workdir(name: str) -> Path:
    """Where cbverify keeps the environments and results it builds (``name``: ``matrix-venvs``, ``engine-envs``): the
    checkout's ``.<name>/`` (gitignored) when run from one, else a user cache folder, ``$CBVERIFY_CACHE/<name>``
    (default ``$XDG_CACHE_HOME/cbverify`` or ``~/.cache/cbverify``), never inside site-packages."""
    root = checkout()
    if root is not None:
        return root / f".{name}"
    cache = (
        os.environ.get("CBVERIFY_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cbverify"
    )
    return Path(cache) / name
