"""``cbverify bisect``: the release search finds the adjacent pair where a repro's verdict changes (or says why it
cannot), ``git bisect run`` names the first bad commit of a synthetic repository built here (no network), and a typed
range is held to a bisection's probes."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbverify.cli import main
from cbverify.upstream import bisect
from cbverify.upstream.bisect import BAD, ERROR, GOOD, Probe


@st.composite
def histories(draw):
    """Versions oldest first, the true verdict of each (one change at most: at ``boundary``), and the releases whose
    probe errs."""
    n = draw(st.integers(1, 40))
    boundary = draw(st.integers(0, n))  # versions[boundary:] have the newer verdict
    fixed = draw(st.booleans())
    errs = draw(st.sets(st.integers(0, n - 1), max_size=n))
    truth = [(GOOD if i < boundary else BAD) if not fixed else (BAD if i < boundary else GOOD) for i in range(n)]
    return [f"1.{i}.0" for i in range(n)], truth, errs


@settings(max_examples=300, deadline=None)
@given(histories())
def test_the_release_search_brackets_the_change_with_adjacent_releases_or_says_why_it_cannot(history):
    versions, truth, errs = history
    asked = []

    def probe(version):
        i = versions.index(version)
        asked.append(i)
        return Probe(version, ERROR if i in errs else truth[i], 0.0)

    result = bisect.search(versions, probe, finding="f", package="p")
    assert len(asked) == len(set(asked)), "a release probed twice"
    clean = [i for i in range(len(versions)) if i not in errs]
    if not clean:
        assert result.change == "unknown"
        return
    first, last = truth[clean[0]], truth[clean[-1]]
    if first == last:
        assert result.change == ("everywhere" if first == BAD else "nowhere")
        return
    lo = max(i for i in clean if truth[i] == first)  # the truth, from every clean release
    hi = min(i for i in clean if truth[i] == last)
    if any(i in errs for i in range(lo + 1, hi)):
        assert result.change == "unknown"  # the change hides among errored releases
        return
    assert result.change == ("introduced" if first == GOOD else "fixed")
    assert (result.before, result.after) == (versions[lo], versions[hi])
    if not errs:
        assert len(asked) <= 2 + math.ceil(math.log2(len(versions)))
    assert result.affected == (f">={versions[hi]}" if first == GOOD else f"<{versions[hi]}")


def test_releases_between_takes_final_releases_in_order_and_minor_prefixes_as_whole_minors():
    listed = ["5.10.0", "5.9.1", "5.9.0", "5.8.2", "5.8.0", "5.10.0rc1", "5.7.3", "5.11.0.dev0", "5.11.0"]
    assert bisect.releases_between("transformers", "5.8", "5.10", listed) == ["5.8.0", "5.8.2", "5.9.0", "5.9.1",
                                                                                "5.10.0"]  # fmt: skip
    assert bisect.releases_between("transformers", "5.8.2", "5.9.0", listed) == ["5.8.2", "5.9.0"]
    assert bisect.parse_range("5.8..5.24") == ("5.8", "5.24")
    for bad in ("5.8", "5.8..", "..5.9", "a..b..c"):
        try:
            bisect.parse_range(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} parsed")


def test_a_typed_range_is_held_to_every_clean_probe_of_a_bisection():
    probes = [Probe("1.0.0", GOOD, 0), Probe("1.4.0", BAD, 0), Probe("1.2.0", ERROR, 0), Probe("1.3.0", BAD, 0)]
    assert bisect.disagreements(">=1.3", probes) == []
    assert bisect.disagreements(">=1.4", probes) == ["1.3.0 probed bad, outside '>=1.4'"]
    assert bisect.disagreements("", probes) == ["1.0.0 probed good, inside 'every version'"]


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_git_bisect_names_the_first_bad_commit_of_a_synthetic_checkout_skipping_one_that_errs(tmp_path):
    """A package whose ``VALUE`` grows a commit at a time; the repro fails from ``VALUE >= 6`` on, and the package does
    not even import at one earlier commit (the repro errs: skipped, as git's 125). The checkout is left as found."""
    repo = tmp_path / "fakepkg-src"
    (repo / "src" / "fakepkg").mkdir(parents=True)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.invalid")
    _git(repo, "config", "user.name", "t")
    shas = []
    for k in range(10):
        body = "raise ImportError('broken at this commit')\n" if k == 4 else f"VALUE = {k}\n"
        (repo / "src" / "fakepkg" / "__init__.py").write_text(body)
        _git(repo, "add", ".")
        _git(repo, "commit", "-q", "-m", f"commit {k}")
        shas.append(subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                   check=True).stdout.strip())  # fmt: skip
    script = tmp_path / "repro.py"
    script.write_text("import sys\nimport fakepkg\nsys.exit(1 if fakepkg.VALUE >= 6 else 0)\n")
    command, env = bisect.checkout_command(script, repo, "fakepkg")
    assert bisect.source_root(repo, "fakepkg") == repo / "src"
    found = bisect.git_bisect(repo, shas[0], shas[-1], command, env=env)
    assert (found.first_bad, found.subject) == (shas[6], "commit 6"), found.log[-1500:]
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert head.strip() == shas[-1]  # reset to where it was
    # read the other way (the behaviour there until commit 6, fixed from then on): the first commit with the fix
    script.write_text("import sys\nimport fakepkg\nsys.exit(0 if fakepkg.VALUE >= 6 else 1)\n")
    fixed = bisect.git_bisect(repo, shas[-1], shas[0], command, env=env)
    assert (fixed.first_bad, fixed.change) == (shas[6], "fixed"), fixed.log[-1500:]
    book = tmp_path / "bisections.json"
    bisect.record(bisect.Bisection("some-finding", "fakepkg", ("1.0", "2.0"), change="fixed", measured="d"), book)
    bisect.record_commit("some-finding", "fakepkg", fixed, ("HEAD~9", "HEAD"), repo, book)
    kept = json.loads(book.read_text())["some-finding"]["fakepkg"]
    assert kept["change"] == "fixed" and kept["commit"]["sha"] == shas[6], kept
    assert kept["commit"]["searched"] == [f"HEAD~9 ({shas[0][:12]})", f"HEAD ({shas[-1][:12]})"], kept
    bisect.record(bisect.Bisection("some-finding", "fakepkg", ("1.0", "3.0"), change="fixed", measured="e"), book)
    assert json.loads(book.read_text())["some-finding"]["fakepkg"]["commit"] == kept["commit"], "a rerun dropped it"
    _git(repo, "checkout", "-q", "-b", "side", shas[2])
    (repo / "side.txt").write_text("x")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "a release branch's patch")
    with pytest.raises(ValueError, match="two lines of history"):
        bisect.git_bisect(repo, "side", shas[-1], command, env=env)
    _git(repo, "checkout", "-q", shas[-1])
    (repo / "src" / "fakepkg" / "__init__.py").write_text("VALUE = 0\n")  # a dirty checkout is refused
    try:
        bisect.git_bisect(repo, shas[0], shas[-1], command, env=env)
    except ValueError as err:
        assert "uncommitted changes" in str(err)
    else:
        raise AssertionError("a dirty checkout was bisected")


def test_the_command_refuses_what_it_cannot_bisect_in_one_line(capsys, tmp_path):
    assert main(["bisect", "no-such-finding", "--trl", "1.0..1.1"]) == 2
    err = capsys.readouterr().err
    assert "unknown finding 'no-such-finding'" in err and "dapo-normaliser-is-not-the-accumulated-batch" in err
    assert "cb-fork-without-room-kills-the-loop" in err  # the fuzz findings, through the scripts cbverify fuzz writes
    assert main(["bisect", "dapo-normaliser-is-not-the-accumulated-batch", "--trl-src", str(tmp_path)]) == 2
    assert "needs --good REF and --bad REF" in capsys.readouterr().err
    assert main(["bisect", "dapo-normaliser-is-not-the-accumulated-batch", "--trl", "1.0"]) == 2
    assert "FIRST..LAST" in capsys.readouterr().err
    assert main(["bisect", "cb-fork-without-room-kills-the-loop", "--trl", "1.0..1.1"]) == 2  # a fuzz finding
    assert "is a transformers finding" in capsys.readouterr().err


def test_every_recorded_bisection_agrees_with_its_finding_s_typed_range():
    """The ranges in the registry are held to the last bisection of each finding (``cbverify bisect --record``): a
    typed range that a probe contradicts fails here."""
    from cbverify.fuzz.findings import BATCH_FINDINGS, FUZZ_FINDINGS
    from cbverify.upstream.findings import FINDINGS

    by_id = {f.id: f for f in (*FINDINGS, *FUZZ_FINDINGS, *BATCH_FINDINGS)}
    for finding_id, packages in bisect.recorded().items():
        assert finding_id in by_id, f"a bisection of {finding_id!r}, which is no longer registered"
        for package, result in packages.items():
            typed = getattr(by_id[finding_id], package)
            assert bisect.disagreements(typed, result.get("probes", [])) == [], (finding_id, package, typed)


def test_the_command_prints_each_probe_the_change_and_the_registry_s_agreement_and_records_it(
    tmp_path, monkeypatch, capsys
):
    """The release form end to end with the probes stood in for (the real ones build a venv per release: the matrix
    marker's documented-command test runs one): a fix at 1.10.0 among 1.0.0..1.16.0, the finding's typed '<1.10'
    agrees, ``--record`` writes it where the registry test reads; a typed range the probes contradict exits 1."""
    versions = [f"1.{m}.{p}" for m in range(17) for p in (0, 1)]
    monkeypatch.setattr(bisect, "releases_between", lambda package, first, last: versions)
    monkeypatch.setattr(bisect, "release_probe", lambda script, package, log: lambda v: Probe(
        v, BAD if int(v.split(".")[1]) < 10 else GOOD, 1.0))  # fmt: skip
    monkeypatch.setattr(bisect, "BISECTIONS", tmp_path / "bisections.json")
    argv = ["bisect", "luspo-token-level-loss-counts-padding", "--trl", "1.0..1.16", "--record"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "34 trl releases 1.0.0..1.16.1" in out and "probe trl 1.0.0: bad" in out
    assert "trl: last bad 1.9.1, first good 1.10.0" in out and "the registry says '<1.10': agrees" in out
    import json

    record = json.loads((tmp_path / "bisections.json").read_text())["luspo-token-level-loss-counts-padding"]["trl"]
    assert (record["change"], record["before"], record["after"], record["affected"]) == ("fixed", "1.9.1", "1.10.0",
                                                                                          "<1.10.0")  # fmt: skip
    monkeypatch.setattr(bisect, "release_probe", lambda script, package, log: lambda v: Probe(
        v, BAD if int(v.split(".")[1]) < 12 else GOOD, 1.0))  # fmt: skip
    assert main(argv[:-1]) == 1
    assert "DISAGREES: 1.10.0 probed bad, outside '<1.10'" in capsys.readouterr().out


def test_the_cli_module_runs_under_python_m(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cbverify", "bisect", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--transformers-src" in proc.stdout
