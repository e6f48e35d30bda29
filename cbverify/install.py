"""Installing packages into the venvs cbverify builds (``cbverify env build``, ``cbverify matrix``): with uv where it
is available, with pip otherwise.

uv resolves and installs a venv in seconds and hard-links files from its cache instead of copying them, so a second
venv of the same packages costs neither minutes nor disk; pip does the same install, slower. Which one runs: the
``CBVERIFY_INSTALLER`` environment variable (``uv`` or ``pip``) when set, else uv when an executable ``uv`` is beside
the running interpreter or on ``PATH``, else pip. uv reads no ``pip.conf``: a package index or a local wheel folder
given to pip through ``PIP_INDEX_URL``, ``PIP_EXTRA_INDEX_URL`` or ``PIP_FIND_LINKS`` (a CPU build of torch, say) is
passed on to it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

INSTALLERS = ("uv", "pip")
_PIP_TO_UV = {"PIP_INDEX_URL": "--index-url", "PIP_EXTRA_INDEX_URL": "--extra-index-url",
              "PIP_FIND_LINKS": "--find-links"}  # fmt: skip


def uv_executable() -> str | None:
    """The ``uv`` to run: beside this interpreter (a venv that has it installed) or on ``PATH``."""
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which("uv")


def installer() -> str:
    """``"uv"`` or ``"pip"`` (see the module docstring); a ``CBVERIFY_INSTALLER`` that cannot be honoured is an
    error, never a silent switch."""
    chosen = os.environ.get("CBVERIFY_INSTALLER", "").strip().lower()
    if chosen and chosen not in INSTALLERS:
        raise ValueError(f"CBVERIFY_INSTALLER={chosen!r}: use one of {', '.join(INSTALLERS)}")
    if chosen == "uv" and uv_executable() is None:
        raise ValueError(
            "CBVERIFY_INSTALLER=uv but no uv executable beside the interpreter or on PATH (pip install uv)"
        )
    return chosen or ("uv" if uv_executable() else "pip")


def _uv_options() -> list[str]:
    options = []
    for variable, flag in _PIP_TO_UV.items():
        for value in os.environ.get(variable, "").split():
            options += [flag, value]
    return options


def command(python: Path, action: str, *args: str) -> list[str]:
    """The command line that runs ``pip <action> args`` for the venv of ``python`` with the chosen installer
    (``action``: ``install``, ``uninstall`` or ``freeze``)."""
    if installer() == "pip":
        quiet = ["--quiet"] if action != "freeze" else []
        yes = ["-y"] if action == "uninstall" else []
        return [str(python), "-m", "pip", action, *quiet, *yes, *args]
    uv = uv_executable()
    options = _uv_options() if action == "install" else []
    quiet = ["--quiet"] if action != "freeze" else []
    return [uv, "pip", action, *quiet, "--python", str(python), *options, *args]


def run(python: Path, action: str, *args: str) -> subprocess.CompletedProcess:
    """:func:`command`, run; its output captured (the caller logs it and decides what a failure means)."""
    return subprocess.run(command(python, action, *args), capture_output=True, text=True)


def create_venv(path: Path) -> Path:
    """A fresh venv at ``path`` (an existing one is cleared); its interpreter. uv's venvs carry no pip, which the
    uv installer does not need."""
    if installer() == "uv":
        subprocess.run([uv_executable(), "venv", "--quiet", "--clear", "--python", sys.executable, str(path)],
                       check=True, capture_output=True)  # fmt: skip
    else:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True)
    return path / "bin" / "python"
