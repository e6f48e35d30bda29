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


def test_a_trl_release_that_cannot_import_beside_transformers_5_runs_beside_the_4x_it_allows(tmp_path):
    """trl 0.28.0 asked beside the installed transformers 5: the column is built with
    :func:`~cbverify.upstream.matrix.paired_transformers`' 4.x, the upstream checks run there, and the paths the
    release lacks are NOT-APPLICABLE (named), never a crash."""
    import transformers

    from cbverify.cli import main
    from cbverify.upstream.matrix import paired_transformers

    paired = paired_transformers(transformers.__version__, "0.28.0")
    assert paired.startswith("4."), paired
    main(["matrix", "--trl", "0.28.0", "--steps", "upstream", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "matrix.json").read_text())
    column = f"transformers-{paired}_trl-0.28.0"
    assert payload["header"][2:] == [column]
    assert payload["versions"][column]["transformers"] == paired and payload["versions"][column]["trl"] == "0.28.0"
    cells = {(row[0], row[1]): row[2] for row in payload["rows"]}
    assert cells[("run_completes", "generate")] == "pass"
    assert cells[("run_completes", "cb")] == cells[("run_completes", "rollout_func")] == "n/a"
    assert not [k for k, v in cells.items() if v == "ERROR"], cells
