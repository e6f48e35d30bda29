"""``cbverify matrix`` end to end (marker ``matrix``: builds or reuses a venv under ``.matrix-venvs/``; minutes)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.upstream, pytest.mark.matrix]


def test_matrix_runs_the_upstream_checks_in_a_cached_venv_for_the_pinned_versions(tmp_path):
    import transformers

    from cbverify.cli import main

    version = transformers.__version__
    rc = main(["matrix", "--transformers", version, "--path", "generate", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "matrix.json").read_text())
    column = f"transformers-{version}_trl-pinned"
    assert payload["header"][2:] == [column]
    assert payload["versions"][column]["transformers"] == version, "the venv must run the requested version"
    cells = {(row[0], row[1]): row[2] for row in payload["rows"]}
    assert cells[("run_completes", "generate")] == "pass"
    assert rc == 0 and not [k for k, v in cells.items() if v in ("FAIL", "ERROR", "INSTALL-FAILED")], cells
    assert (tmp_path / "matrix.md").read_text().startswith("| check | path |")
