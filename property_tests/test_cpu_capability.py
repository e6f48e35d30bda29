"""Verdicts do not depend on the CPU kernels torch dispatches to.

torch picks its CPU kernels by the machine's instruction set (AVX512, AVX2, ...); ``ATEN_CPU_CAPABILITY`` forces
another one. Float32 sums then round in another order, so logits move in their last bits: a verdict that changes
with that (a sampled token flipping at a near-tie judged as a divergence, a golden outside its tier, a statistical
check calling a peaked distribution a bug) depends on the machine, not on the engine. The same ``cbverify verify``
runs here under the native kernels and under the portable ones (``default``, which every x86 and ARM build has) and
must give every engine the same verdict. The full comparison (``make test``, ``upstream --run`` on 1 and 2 processes)
is ``make cpu-capabilities``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

PORTABLE = "DEFAULT"


def _verify(tmp_path, capability: str | None) -> dict:
    out = tmp_path / f"{capability or 'native'}.json"
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability.lower()
    argv = [sys.executable, "-m", "cbverify", "verify", "--num-prompts", "1", "--max-new-tokens", "8",
            "--dist-samples", "60", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert out.is_file(), f"verify wrote no report (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(out.read_text())


def test_verify_gives_every_engine_the_same_verdict_under_the_portable_kernels(tmp_path):
    native = torch.backends.cpu.get_cpu_capability()
    if native == PORTABLE:
        pytest.skip("this machine's native kernels are the portable ones: nothing to compare")
    reports = {name: _verify(tmp_path, capability) for name, capability in (("native", None), ("portable", PORTABLE))}
    assert reports["native"]["environment"]["cpu capability"] == native
    assert reports["portable"]["environment"]["cpu capability"] == PORTABLE, "ATEN_CPU_CAPABILITY was not honoured"
    verdicts = {name: {row["engine"]: row["status"] for row in r["engines"]} for name, r in reports.items()}
    assert verdicts["native"] == verdicts["portable"], verdicts
    compared = {name: sum(row["tokens_compared"] for row in r["engines"]) for name, r in reports.items()}
    assert compared["native"] == compared["portable"] > 0, compared
