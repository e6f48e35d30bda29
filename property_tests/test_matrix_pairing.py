"""Which transformers ``cbverify matrix`` builds a trl release with
(:func:`cbverify.upstream.matrix.paired_transformers`) and how it reads a release's requirement off its wheel
(:func:`~cbverify.upstream.matrix.requires`). No venv is built and the package index is not asked: both are replaced
by fixed answers."""

from __future__ import annotations

import zipfile

import pytest

from cbverify.upstream import matrix
from cbverify.upstream.trl_compat import TRANSFORMERS_5_FROM

INDEX = ("5.24.0", "5.0.0", "4.58.0rc1", "4.57.6", "4.57.5", "4.50.0", "4.46.0", "4.45.2")


@pytest.fixture()
def index(monkeypatch):
    """The index lists :data:`INDEX`; trl 0.28.0 requires ``>=4.46,!=4.57.6`` and 0.14.0 ``>=4.58`` (none final)."""
    from packaging.specifiers import SpecifierSet

    wanted = {"0.28.0": SpecifierSet(">=4.46,!=4.57.6"), "0.14.0": SpecifierSet(">=4.58")}
    monkeypatch.setattr(matrix, "index_versions", lambda package: INDEX)
    monkeypatch.setattr(matrix, "requires", lambda package, version, dependency: wanted[version])


def test_a_release_that_needs_transformers_4_gets_the_newest_final_4x_its_metadata_allows(index):
    # 5.x is not 4.x, 4.58.0rc1 is a pre-release, 4.57.6 is excluded by the requirement: 4.57.5 is what is left on top
    assert matrix.paired_transformers("5.24.0", "0.28.0") == "4.57.5"
    assert matrix.combo_name("5.24.0", "0.28.0") == "transformers-4.57.5_trl-0.28.0"


def test_what_is_asked_stays_where_it_can_run(index, tmp_path):
    assert matrix.paired_transformers("5.24.0", TRANSFORMERS_5_FROM + ".0") == "5.24.0"  # imports beside 5.x
    assert matrix.paired_transformers("4.50.0", "0.28.0") == "4.50.0"  # a 4.x asked for explicitly
    assert matrix.paired_transformers("5.24.0", None) == "5.24.0"  # the pinned trl
    assert matrix.paired_transformers("5.24.0", str(tmp_path)) == "5.24.0"  # a checkout: its version is unknown


def test_no_final_4x_in_the_requirement_is_an_error_naming_it(index):
    with pytest.raises(RuntimeError, match=r"trl 0.14.0 allows transformers >=4.58"):
        matrix.paired_transformers("5.24.0", "0.14.0")


def test_the_requirement_is_read_off_the_wheel_without_the_extras(monkeypatch, tmp_path):
    folder = tmp_path / "matrix-venvs" / "_metadata"
    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / "trl-9.9.9-py3-none-any.whl", "w") as wheel:
        wheel.writestr("trl-9.9.9.dist-info/METADATA", "\n".join([
            "Metadata-Version: 2.4", "Name: trl", "Version: 9.9.9",
            "Requires-Dist: accelerate>=1.4.0",
            "Requires-Dist: transformers>=4.56.2",
            'Requires-Dist: transformers!=5.1.0; extra == "deepspeed"',
            'Requires-Dist: transformers<5.0.0; extra == "judges"',
        ]))  # fmt: skip
    monkeypatch.setattr(matrix.data, "workdir", lambda name: tmp_path / name)
    matrix.requires.cache_clear()
    try:
        assert str(matrix.requires("trl", "9.9.9", "transformers")) == ">=4.56.2"
    finally:
        matrix.requires.cache_clear()
