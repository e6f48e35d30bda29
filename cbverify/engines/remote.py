"""An engine in another process (and, with ``env``, another venv), behind the ordinary Engine protocol.

:class:`RemoteEngine` starts ``python -m cbverify.engines.worker`` with the environment's interpreter (``env=None``:
this interpreter, which the tests use to check the protocol on the engines of the main venv), hands it the model as a
checkpoint folder, and speaks the worker's JSON-lines protocol (documented in :mod:`cbverify.engines.worker`). The
oracle, the comparisons and the verdicts stay in this process; only ``generate`` crosses.

The checkpoint: the weights the caller holds in memory are what gets judged, so the model is written to a temporary
folder with ``save_pretrained`` (a tiny checkpoint takes milliseconds) unless ``checkpoint=PATH`` names the folder it
was loaded from unchanged (a large model: no copy). A missing or stale environment raises ``NotApplicable`` with the
command that builds it; a worker that dies, answers an error or does not answer within ``timeout_s`` (then it is
killed) raises ``EngineError`` with the end of its log.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from cbverify import data
from cbverify.engines import Capabilities, EngineError, NotApplicable, RunStats, check_unique_ids, envs
from cbverify.engines.worker import request_to_json, rollout_from_json
from reference.spec import Rollout, RolloutRequest

DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


class RemoteEngine:
    """``engine`` served by a worker in environment ``env``; ``options`` go to the engine's constructor there."""

    def __init__(
        self,
        model,
        *,
        engine: str,
        env: str | None,
        checkpoint: str | None = None,
        name: str | None = None,
        timeout_s: float = 600.0,
        **options,
    ) -> None:
        self.name, self.timeout_s = name or engine, timeout_s
        self._proc, self._tmp, self.log_path = None, None, None  # what close() releases, set before anything fails
        if env is not None and (why := envs.problem(env)) is not None:
            raise NotApplicable(engine, why)
        python = sys.executable if env is None else str(envs.python(env))
        if checkpoint is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"cbverify-{engine}-")
            model.save_pretrained(self._tmp.name)
            checkpoint = self._tmp.name
        self.log_path = Path(tempfile.mkstemp(prefix=f"cbverify-{engine}-", suffix=".log")[1])
        child_env = {**os.environ, "PYTHONPATH": str(data.import_path()), "HF_HUB_OFFLINE": "1",
                     "TRANSFORMERS_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip
        with open(self.log_path, "w") as log:
            self._proc = subprocess.Popen([python, "-m", "cbverify.engines.worker"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log, text=True, env=child_env,
                                          cwd=tempfile.gettempdir())  # fmt: skip
        dtype = DTYPE_NAMES.get(str(getattr(model, "dtype", "torch.float32")), "float32")
        start = {"op": "start", "engine": engine, "model": checkpoint, "dtype": dtype,
                 "threads": torch.get_num_threads(), "options": options}  # fmt: skip
        answer = self._call(start)
        self.capabilities = Capabilities(**answer["capabilities"])
        self.versions: dict = answer["versions"]
        self.startup_s: float = answer["startup_s"]
        self.last_run: RunStats | None = None

    def _log_tail(self, lines: int = 15) -> str:
        text = (
            self.log_path.read_text(errors="replace").splitlines() if self.log_path and self.log_path.exists() else []
        )
        return "\n".join(text[-lines:])

    def _call(self, message: dict) -> dict:
        if self._proc.poll() is not None:
            raise EngineError(f"{self.name}: the worker exited ({self._proc.returncode}); its log ends:\n"
                              f"{self._log_tail()}")  # fmt: skip
        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout_s)
        if not ready:  # a hung engine is a failure with its log, never a hung suite
            self._proc.kill()
            self._proc.wait()
            raise EngineError(f"{self.name}: no answer to {message['op']!r} within {self.timeout_s:.0f} s (worker "
                              f"killed); its log ends:\n{self._log_tail()}")  # fmt: skip
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            raise EngineError(f"{self.name}: the worker died ({self._proc.returncode}) during {message['op']!r}; "
                              f"its log ends:\n{self._log_tail()}")  # fmt: skip
        answer = json.loads(line)
        if answer["ok"]:
            return answer
        if answer["kind"] == "not_applicable":
            raise NotApplicable(self.name, answer["message"])
        raise EngineError(f"{self.name}: {answer['message']}")

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        check_unique_ids(self.name, requests)
        answer = self._call({"op": "generate", "requests": [request_to_json(r) for r in requests]})
        self.last_run = RunStats(**answer["stats"]) if answer["stats"] else None
        return [rollout_from_json(r) for r in answer["rollouts"]]

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self._proc.stdin.flush()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if self.log_path is not None:  # its tail is in every error raised before this
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    def __del__(self) -> None:
        self.close()


def vllm(model, **options) -> RemoteEngine:
    """The ``vllm`` engine: :class:`cbverify.engines.vllm_engine.VLLMEngine` in the ``vllm`` environment."""
    return RemoteEngine(model, engine="vllm", env="vllm", **options)
