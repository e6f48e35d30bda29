"""``cbverify verify`` end to end on a tiny workload: a clean run exits 0 and writes its JSON / Markdown reports; an
engine swapped for a faulty adapter turns its row FAIL and the exit code non-zero (same checks as the tests), in
float32 and in bfloat16 (each in the tier of its dtype)."""

from __future__ import annotations

import json

import pytest

from cbverify import engines as engines_module
from cbverify.cli import main


def _argv(tmp_path, *extra: str) -> list[str]:
    return ["verify", "--num-prompts", "1", "--max-new-tokens", "8", "--dist-samples", "60",
            "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md"), *extra]  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_passes_every_engine_on_the_bundled_model_and_writes_both_reports(tmp_path, capsys, dtype):
    assert main(_argv(tmp_path, "--dtype", dtype)) == 0
    out = capsys.readouterr().out
    for field in ("torch=", "transformers=", "trl=", "device=cpu", f"dtype={dtype}"):
        assert field in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert [row["engine"] for row in report["engines"]] == ["reference", "cb_impl", "hf-generate", "transformers-cb"]
    assert all(row["status"] == "PASS" for row in report["engines"])
    assert "| reference | PASS |" in (tmp_path / "r.md").read_text()
    assert "\033[" not in out, "colour codes must only be written to a terminal"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fault", ["ShiftedLogprobs", "DroppedLastToken", "CompletionOrder"])
def test_verify_exits_non_zero_when_an_engine_is_faulty(tmp_path, monkeypatch, fault, dtype):
    monkeypatch.setitem(engines_module.ENGINE_MODULES, "cb_impl", ("property_tests.faulty", fault))
    assert main(_argv(tmp_path, "--engines", "cb_impl", "--dist-samples", "0", "--dtype", dtype)) == 1
    rows = json.loads((tmp_path / "r.json").read_text())["engines"]
    assert [r["status"] for r in rows] == ["FAIL"], rows
