"""Environment capture and diff: what a golden was recorded on, and what changed since.

Contract:

- :func:`capture` returns a flat, JSON-serialisable ``dict[str, str | int | bool]`` describing the numerics-relevant
  environment (package versions, device, CPU capability, thread count, git commit) plus the volatile provenance keys
  in :data:`VOLATILE_KEYS` (timestamp, host name), which never count as a difference.
- :func:`diff` lists, one human-readable line per key, every non-volatile key whose value differs between a recorded
  environment and the current one (``"torch: 2.13.0+cpu -> 2.14.0+cpu"``). An empty list means "same environment".
- :func:`device_class` names the folder a device's goldens live in: ``cpu`` or ``cuda-<device name slug>``.
- :func:`git_dirty_paths` lists the paths ``git status`` reports as changed, so the recorder can refuse a dirty tree.
"""

from __future__ import annotations

import datetime as _dt
import platform
import re
import socket
import subprocess
from importlib import metadata
from pathlib import Path

import torch

import cbverify
from cbverify import data

VOLATILE_KEYS = frozenset({"timestamp", "hostname"})
_PACKAGES = ("torch", "transformers", "trl", "accelerate", "tokenizers", "safetensors", "numpy")


def slug(text: str) -> str:
    """Lower-case, runs of non-alphanumerics -> ``-``: ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def device_class(device: str | torch.device) -> str:
    """``"cpu"`` for any CPU, ``"cuda-<slug of the device name>"`` for a CUDA device (each GPU type keeps its own)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available")
        return "cuda-" + slug(torch.cuda.get_device_name(device))
    raise ValueError(f"unsupported device type {device.type!r}: goldens exist for cpu and cuda only")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    """``git`` in the checkout cbverify runs from (never in whatever repository an installed package sits in)."""
    root = data.checkout()
    if root is None:
        raise RuntimeError("cbverify is installed, not run from a checkout: no git commit to report")
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"`git {' '.join(args)}` failed in {root}: {out.stderr.strip()}")
    return out.stdout


def git_commit() -> str:
    """The checked-out commit (40 hex digits), or ``"unknown"`` for an installed cbverify or outside git."""
    try:
        return _git("rev-parse", "HEAD").strip()
    except (RuntimeError, FileNotFoundError):
        return "unknown"


def git_dirty_paths(*, ignore: tuple[str, ...] = ()) -> list[str]:
    """Paths with uncommitted changes (tracked or untracked, not ignored), minus those under any ``ignore`` prefix.

    Raises ``RuntimeError`` outside a git checkout: provenance needs a commit.
    """
    paths = []
    for line in _git("status", "--porcelain", "--untracked-files=all").splitlines():
        path = line[3:].split(" -> ")[-1].strip('"')
        if not any(path.startswith(prefix) for prefix in ignore):
            paths.append(path)
    return paths


def capture(device: str | torch.device = "cpu") -> dict[str, str | int | bool]:
    """The environment a golden is recorded or checked on (see the module contract)."""
    device = torch.device(device)
    env: dict[str, str | int | bool] = {}
    for name in _PACKAGES:
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = "absent"
    env["torch"] = torch.__version__
    env["python"] = platform.python_version()
    env["platform"] = f"{platform.system()}-{platform.machine()}"
    env["device_class"] = device_class(device)
    env["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model()
    env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    env["torch_num_threads"] = torch.get_num_threads()
    if device.type == "cuda":
        env["cuda"] = str(torch.version.cuda)
        env["cudnn"] = str(torch.backends.cudnn.version())
        env["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
    env["cbverify"] = cbverify.__version__
    env["git_commit"] = git_commit()
    env["timestamp"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    env["hostname"] = socket.gethostname()
    return env


def diff(recorded: dict, current: dict) -> list[str]:
    """One line per non-volatile key whose value differs, in sorted key order (``"<missing>"`` for absent keys)."""
    lines = []
    for key in sorted((set(recorded) | set(current)) - VOLATILE_KEYS):
        old, new = recorded.get(key, "<missing>"), current.get(key, "<missing>")
        if old != new:
            lines.append(f"{key}: {old} -> {new}")
    return lines


def format_diff(recorded: dict, current: dict) -> str:
    """:func:`diff` as an indented block for failure messages; says so explicitly when nothing changed."""
    lines = diff(recorded, current)
    if not lines:
        return "  environment: unchanged since recording (so the code or the model changed)"
    return "  environment changed since recording:\n" + "\n".join(f"    {line}" for line in lines)
