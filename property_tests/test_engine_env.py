"""Engines in a process (and a venv) of their own: the worker protocol loses nothing, a missing or stale environment
is NOT-APPLICABLE with the command that builds it, a failing worker is an error naming the cause; and, marked ``vllm``
(``make test-vllm``), vLLM itself through ``cbverify verify``: clean it passes, a faulty adapter turns its row FAIL."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings

from cbverify import engines as engines_module
from cbverify.cli import main
from cbverify.engines import EngineError, NotApplicable, envs, get_engine
from cbverify.engines.remote import RemoteEngine
from cbverify.upstream.env_findings import ENV_FINDINGS
from cbverify.upstream.findings import SCRIPTS
from property_tests.helpers import needs_vllm
from property_tests.strategies import rollout_requests


@pytest.fixture(scope="module")
def remote_cb_impl(llama):
    engine = RemoteEngine(llama.model, engine="cb_impl", env=None)
    yield engine
    engine.close()


@settings(max_examples=10)
@given(requests=rollout_requests(max_requests=4, group_size=(1, 2)))
def test_an_engine_behind_the_worker_returns_exactly_what_it_returns_in_process(llama, remote_cb_impl, requests):
    """Token ids, log-probs to the last bit (JSON carries the float's repr), finish reasons, order: lossless."""
    assert remote_cb_impl.generate(requests) == get_engine("cb_impl", llama.model).generate(requests)
    assert remote_cb_impl.capabilities == get_engine("cb_impl", llama.model).capabilities


def test_a_missing_or_stale_environment_is_not_applicable_with_the_build_command(llama, tmp_path, monkeypatch):
    monkeypatch.setenv("CBVERIFY_ENGINE_ENVS", str(tmp_path))
    with pytest.raises(NotApplicable, match="run `cbverify env build vllm`"):
        get_engine("vllm", llama.model)
    (tmp_path / "vllm" / "bin").mkdir(parents=True)
    (tmp_path / "vllm" / "bin" / "python").write_text("")
    (tmp_path / "vllm" / ".cbverify-stamp").write_text("built-from-other-pins")
    assert "other constraints" in envs.problem("vllm") and "cbverify env build vllm" in envs.problem("vllm")


def test_verify_reports_a_missing_environment_as_na_with_the_build_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CBVERIFY_ENGINE_ENVS", str(tmp_path))
    argv = ["verify", "--engines", "vllm", "--num-prompts", "1", "--max-new-tokens", "4", "--dist-samples", "0",
            "--json", str(tmp_path / "r.json")]  # fmt: skip
    assert main(argv) == 1
    assert main([*argv, "--allow-na"]) == 0
    (row,) = json.loads((tmp_path / "r.json").read_text())["engines"]
    assert row["status"] == "N/A" and "cbverify env build vllm" in " ".join(row["problems"])


def test_a_worker_that_cannot_build_its_engine_is_an_error_naming_why(llama):
    with pytest.raises(EngineError, match="ModuleNotFoundError"):
        RemoteEngine(llama.model, engine="no_such_module:Engine", env=None)
    with pytest.raises(EngineError, match="hosts no engine 'nope'"):
        RemoteEngine(llama.model, engine="nope", env=None)


def _verify(tmp_path, *extra: str) -> tuple[int, dict[str, dict]]:
    code = main(["verify", "--engines", "vllm", "--num-prompts", "2", "--max-new-tokens", "12", "--dist-samples", "60",
                 "--json", str(tmp_path / "r.json"), *extra])  # fmt: skip
    return code, {r["engine"]: r for r in json.loads((tmp_path / "r.json").read_text())["engines"]}


@pytest.mark.vllm
@needs_vllm
def test_vllm_passes_verify_in_processed_mode_and_in_raw_mode_declared_raw(tmp_path, monkeypatch):
    """Its pressure run (a token budget below the longest prompt: chunked prefills of seeded requests) hits the
    registered vllm-cpu-seeded-chunked-prefill-crashes: reported as that XFAIL, not as a pass or an unknown FAIL."""
    code, rows = _verify(tmp_path)
    assert code == 0 and rows["vllm"]["status"] == "PASS", rows
    assert rows["vllm[pressure]"]["status"] == "XFAIL(vllm-cpu-seeded-chunked-prefill-crashes)", rows
    monkeypatch.setitem(engines_module.ENGINE_MODULES, "vllm", ("property_tests.test_engine_env", "_raw_vllm"))
    code, rows = _verify(tmp_path, "--no-pressure")
    assert code == 0 and rows["vllm"]["status"] == "PASS", rows


@pytest.mark.vllm
@needs_vllm
def test_verify_sizes_vllm_s_context_to_the_workload_not_to_the_checkpoint_s_positions(tmp_path):
    """A checkpoint declaring more positions than a KV cache of vLLM's 10 % of RAM holds for one whole context (the
    smallest power of two above twice that, from this machine's RAM and the bundled Llama's 2 KiB of KV per token:
    2**22 on 23 GB), so vLLM built with its own default context refuses to start; verify gives it the workload's
    longest request and it runs."""
    import shutil

    from cbverify.engines import kv_bytes_per_token
    from reference.models import load, resolve

    folder = tmp_path / "long-context"
    shutil.copytree(resolve("tiny-llama-arith"), folder)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    positions = 1 << int(2 * 0.1 * ram // kv_bytes_per_token(load("tiny-llama-arith")[0])).bit_length()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": positions}))
    model, _ = load(folder)
    with pytest.raises(EngineError, match="(?i)max seq len|max_model_len|kv cache"):
        get_engine("vllm", model, checkpoint=str(folder)).generate([])
    code = main(["verify", "--model", str(folder), "--engines", "vllm", "--num-prompts", "2", "--max-new-tokens", "8",
                 "--dist-samples", "0", "--no-pressure", "--json", str(tmp_path / "r.json")])  # fmt: skip
    (row,) = json.loads((tmp_path / "r.json").read_text())["engines"]
    assert code == 0 and row["status"] == "PASS", row


def _raw_vllm(model, **options):
    return RemoteEngine(model, engine="vllm", env="vllm", name="vllm", logprobs_mode="raw_logprobs", **options)


def _faulty_vllm(model, **options):
    return RemoteEngine(model, engine="property_tests.faulty_vllm:RawLogprobsDeclaredProcessed", env="vllm",
                        name="vllm", **options)  # fmt: skip


@pytest.mark.vllm
@needs_vllm
def test_verify_fails_a_vllm_adapter_that_returns_raw_log_probs_while_declaring_processed(tmp_path, monkeypatch):
    monkeypatch.setitem(engines_module.ENGINE_MODULES, "vllm", ("property_tests.test_engine_env", "_faulty_vllm"))
    code, rows = _verify(tmp_path, "--no-pressure")
    assert code == 1 and rows["vllm"]["status"] == "FAIL", rows
    assert any("log-prob" in p or "logprob" in p for p in rows["vllm"]["problems"]), rows["vllm"]["problems"]


def test_every_environment_finding_names_its_environment_and_an_existing_script():
    for finding in ENV_FINDINGS:
        assert finding.env in envs.ENVS, finding.id
        assert (SCRIPTS / finding.script).is_file(), f"{finding.id}: no script {finding.script}"


@pytest.mark.vllm
@pytest.mark.parametrize("finding", [f for f in ENV_FINDINGS if f.env == "vllm"], ids=lambda f: f.id)
@needs_vllm
def test_every_vllm_environment_finding_still_reproduces(finding):
    """Strict: the script exits 1 while the upstream behaviour stands; exit 0 means fixed: update the registry. Judged
    by the repro protocol's exit code (2: the script could not run), never by what vLLM logs on stderr."""
    from cbverify.upstream.bisect import BAD, run_script

    verdict, last = run_script(
        str(envs.python("vllm")), SCRIPTS / finding.script, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert verdict == BAD, (
        f"{finding.id}: {verdict} (good: fixed upstream? update ENV_FINDINGS; error: exit 2): {last}"
    )


def test_a_worker_that_does_not_answer_in_time_is_killed_and_reported(llama, monkeypatch):
    engine = RemoteEngine(llama.model, engine="property_tests.faulty_vllm:Hangs", env=None, timeout_s=120)
    engine.timeout_s = 3  # the start (imports) may be slow on a loaded machine; the hang is in generate
    with pytest.raises(EngineError, match="no answer to 'generate' within 3 s"):
        engine.generate([])
    assert engine._proc.poll() is not None, "the hung worker is still running"
    # closing it leaves nothing in the temporary folder: neither the checkpoint saved for the worker nor its log
    saved, log = Path(engine._tmp.name), engine.log_path
    assert saved.is_dir() and log.is_file()
    engine.close()
    assert not saved.exists() and not log.exists()
