"""``docs/releases.md`` is generated from matrix runs: each cell is read from the matrix's row for the finding's repro
and the release's versions against the finding's typed range, never written by hand."""

from __future__ import annotations

import json

from cbverify.upstream import releases_page
from cbverify.upstream.findings import by_id

EVAL = by_id("eval-loss-divided-by-training-accumulation")  # trl >=0.22,<0.27.1
ROW = releases_page.SCRIPT_TESTS["upstream"].format(EVAL.id)


def _versions(trl: str) -> dict[str, str]:
    return {"transformers": "4.57.6", "trl": trl}


def test_a_cell_says_affected_inside_the_range_not_affected_outside_and_names_what_a_release_lacks():
    assert releases_page.cell("upstream", EVAL, _versions("0.24.0"), {ROW: "pass"}) == "affected"
    assert releases_page.cell("upstream", EVAL, _versions("0.27.1"), {ROW: "pass"}) == "not affected"
    lacks = "n/a(trl 0.21.0: GRPOTrainer has no _generate)"
    assert releases_page.cell("upstream", EVAL, _versions("0.21.0"), {ROW: lacks}) == lacks
    assert releases_page.cell("upstream", EVAL, _versions("0.24.0"), {ROW: "FAIL"}).startswith(
        "CONTRADICTS trl >=0.22,<0.27.1"
    )
    assert releases_page.cell("upstream", EVAL, _versions("0.24.0"), {}) == "not run"


def test_the_page_has_a_column_per_release_and_a_row_per_finding(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    header = ["check", "path", "transformers-4.57.6_trl-0.24.0", "transformers-4.57.6_trl-0.27.1"]
    payload = {"versions": {header[2]: _versions("0.24.0"), header[3]: _versions("0.27.1")},
               "seconds": {header[2]: 600.0, header[3]: 590.0}, "header": header,
               "rows": [[ROW, "pytest", "pass", "pass"]]}  # fmt: skip
    (run / "matrix.json").write_text(json.dumps(payload))
    out = tmp_path / "releases.md"
    assert releases_page.main([str(run), "--out", str(out)]) == 0
    page = out.read_text()
    line = next(x for x in page.splitlines() if x.startswith(f"| `{EVAL.id}`"))
    assert line.endswith("| affected | not affected |"), line
    assert "trl: fixed in 0.27.1" in line  # the recorded bisection
    assert f"python -m cbverify.upstream.releases_page {run}" in page
    rows = [x for x in page.splitlines() if x.startswith("| `") and "(upstream)" in x or "(fuzz)" in x]
    assert len(rows) == len(releases_page._findings())
    assert releases_page.main([str(tmp_path / "nothing")]) == 2
    assert "no matrix.json" in capsys.readouterr().err
