"""Nothing the command line or a TRL scenario run creates under the temporary folder outlives it.

Each test points ``tempfile`` (and ``TMPDIR``, for any child process) at a fresh private folder, so what other
processes on the machine do in the shared temporary folder cannot make it flaky, and then requires that folder to be
empty again: every ``cbverify-*`` entry (the trainer's ``cbverify-trl-*`` output folder, the recipe reader's, the
zoo's) and anything else.
"""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

import pytest

from cbverify.cli import main

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """A fresh, empty temporary folder every ``tempfile`` call of the test uses."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))
    assert tempfile.gettempdir() == str(folder)
    return folder


def left_behind(folder: Path) -> list[str]:
    gc.collect()  # a trainer in a reference cycle is only collected here; its output folder goes with it
    return sorted(os.listdir(folder))


def test_a_trl_scenario_run_leaves_no_output_folder(private_tmp, llama):
    from cbverify.upstream.run import run_scenario
    from cbverify.upstream.scenario import TrainerScenario

    capture = run_scenario(TrainerScenario(), llama.model, llama.tokenizer)  # the cheapest: generate path, 1 step
    assert capture.run_error is None
    assert left_behind(private_tmp) == []


def test_a_trainer_built_and_released_leaves_no_output_folder_even_while_referenced(private_tmp, llama):
    import copy

    from cbverify.upstream.scenario import TrainerScenario, build_trainer, release_trainer

    trainer = build_trainer(TrainerScenario(), copy.deepcopy(llama.model), llama.tokenizer)
    made = [p for p in os.listdir(private_tmp) if p.startswith("cbverify-trl-")]
    assert len(made) == 1 and Path(trainer.args.output_dir).name == made[0]
    release_trainer(trainer)
    assert os.listdir(private_tmp) == []  # at once, with the trainer still alive
    del trainer
    assert left_behind(private_tmp) == []


def test_a_trainer_that_cannot_be_built_leaves_no_output_folder(private_tmp, llama, monkeypatch):
    from cbverify.upstream import scenario

    def refuse(*args, **kwargs):
        raise ValueError("refused")

    monkeypatch.setattr(scenario, "make_dataset", refuse)
    with pytest.raises(ValueError, match="refused"):
        scenario.build_trainer(scenario.TrainerScenario(), llama.model, llama.tokenizer)
    assert os.listdir(private_tmp) == []


def test_cli_commands_leave_nothing_in_the_temporary_folder(private_tmp, tmp_path, capsys, monkeypatch):
    """``verify`` with a recipe (the recipe reader builds a GRPOConfig in a temporary folder) and a refused input;
    run from an empty folder, which the recipe's own ``output_dir`` (``runs/grpo-tiny``) must not appear in."""
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    argv = ["verify", "--engines", "reference", "--model", "tiny-qwen3-chat", "--num-prompts", "1", "--group-size",
            "1", "--max-new-tokens", "2", "--dist-samples", "0", "--no-pressure", "--grpo-config",
            str(REPO / "examples" / "grpo_recipe.yaml"), "--json", str(tmp_path / "r.json")]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("temperature: 0\n")
    assert main([*argv[:-4], "--grpo-config", str(tmp_path / "bad.yaml")]) == 2
    assert left_behind(private_tmp) == []
    assert os.listdir(workdir) == []
