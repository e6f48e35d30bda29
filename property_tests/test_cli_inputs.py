"""Every input the command line reads gets one line on stderr and exit 2, or a valid report: never a traceback.

Two Hypothesis properties drive ``cbverify verify`` in-process (``cbverify.cli.main``, stdout, stderr and the
libraries' log handlers captured) on drawn corruptions of a temporary copy of a bundled checkpoint (a file deleted,
truncated at a drawn offset, bytes flipped, a JSON file replaced by junk or by JSON of the wrong types, a required key
dropped) and of the example prompts and recipe under ``examples/`` (the same, plus rows and values of the wrong
shape). Each run must exit 0, 1 or 2, print no traceback, and exit 2 only with exactly one line on stderr. Then the
flag bounds: every numeric flag of ``verify``, ``golden``, ``zoo``, ``fuzz``, ``bench``, ``train`` and ``conformance``
accepts its bound and refuses one step past it (exit 2, one line naming the flag).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import shutil
import tempfile
import traceback
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbverify.cli import build_parser, main
from property_tests.helpers import SUMMARY
from reference.models import MODELS_DIR

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
LLAMA = MODELS_DIR / "tiny-llama-arith"
CHECKPOINT_FILES = sorted(p.name for p in LLAMA.iterdir() if p.is_file())
JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
# the keys a loader needs, per file: dropping one must be refused or survived, never a traceback
REQUIRED = {
    "config.json": ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "max_position_embeddings", "head_dim", "rope_parameters", "hidden_act"),
    "tokenizer.json": ("model", "added_tokens", "pre_tokenizer", "decoder", "post_processor", "normalizer"),
    "tokenizer_config.json": ("tokenizer_class", "eos_token", "pad_token", "bos_token", "backend"),
    "generation_config.json": ("eos_token_id", "pad_token_id", "bos_token_id"),
}  # fmt: skip
CHEAP = ["verify", "--engines", "reference", "--num-prompts", "2", "--group-size", "1", "--max-new-tokens", "2",
         "--dist-samples", "0", "--no-pressure"]  # fmt: skip
FOUND: dict[str, list[str]] = {}  # what the properties saw, by exit code: in pytest's terminal summary

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                         st.text(max_size=12))  # fmt: skip
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=8), inner, max_size=3), max_leaves=8)  # fmt: skip


@contextlib.contextmanager
def captured():
    """``(stdout, stderr)`` buffers holding everything the block prints: ``sys.stdout`` / ``sys.stderr``, Python
    warnings (shown as a plain run shows them, not recorded by pytest) and every plain ``StreamHandler`` of the
    logging tree (transformers' included, bound to whatever stderr was when it was made)."""
    out, err = io.StringIO(), io.StringIO()
    handlers = []
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            if type(handler) is logging.StreamHandler:
                handlers.append((handler, handler.setStream(err)))
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.showwarning = warnings._showwarning_orig  # type: ignore[attr-defined]
            warnings.simplefilter("default")
            yield out, err
    finally:
        for handler, stream in handlers:
            handler.setStream(stream)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` in-process: ``(exit code, stdout, stderr)``; an exception escaping it is a failure."""
    with captured() as (out, err):
        try:
            code = main(argv)
        except BaseException:  # noqa: BLE001 - a traceback out of the command is exactly what is tested for
            pytest.fail(f"cbverify {' '.join(argv)} raised:\n{traceback.format_exc()}\nstderr:\n{err.getvalue()}")
    return code, out.getvalue(), err.getvalue()


def assert_one_line_or_report(argv: list[str], what: str) -> int:
    code, out, err = run_cli(argv)
    assert code in (0, 1, 2), (what, code, err[-2000:])
    assert "Traceback" not in out and "Traceback" not in err, (what, err[-3000:])
    lines = err.strip().splitlines()
    if code == 2:
        assert len(lines) == 1, (what, lines)
        assert lines[0].startswith("cbverify verify: error: "), (what, lines)
    seen = lines[0] if code == 2 else what
    FOUND.setdefault(str(code), []).append(re.sub(r"\S*cbverify-test-\S+?/", "", seen)[:140])
    return code


def teardown_module() -> None:
    for code, seen in sorted(FOUND.items()):
        SUMMARY.append(f"test_cli_inputs: exit {code}: {len(seen)} runs, {len(set(seen))} distinct")
        SUMMARY.extend(f"    {line}" for line in sorted(set(seen))[:60])


# --- corruptions ---------------------------------------------------------------------------------------------------


@st.composite
def file_corruptions(draw, files: tuple[str, ...], sizes: dict[str, int]) -> tuple:
    """One corruption of one of ``files``: deleted, truncated at a drawn offset, or bytes flipped at drawn offsets
    (``sizes``: each file's length, offsets near the start, where headers live, drawn as often as any)."""
    name = draw(st.sampled_from(files))
    size = sizes[name]
    offset = st.one_of(st.integers(0, min(size, 64) - 1), st.integers(0, size - 1))
    kind = draw(st.sampled_from(["delete", "truncate", "flip"]))
    if kind == "delete":
        return ("delete", name)
    if kind == "truncate":
        return ("truncate", name, draw(offset))
    flips = draw(st.lists(st.tuples(offset, st.integers(1, 255)), min_size=1, max_size=4))
    return ("flip", name, tuple(flips))


@st.composite
def json_corruptions(draw, required: dict[str, tuple[str, ...]]) -> tuple:
    """One corruption of a JSON file's meaning: replaced by junk bytes or by a JSON value of the wrong type, one of
    its keys given a value of another type, or a required key dropped."""
    name = draw(st.sampled_from(sorted(required)))
    kind = draw(st.sampled_from(["junk", "json", "retype", "drop"]))
    if kind == "junk":
        return ("junk", name, draw(st.binary(max_size=64)))
    if kind == "json":
        return ("json", name, draw(json_values))
    key = draw(st.sampled_from(required[name]))
    return ("retype", name, key, draw(json_values)) if kind == "retype" else ("drop", name, key)


def apply(corruption: tuple, folder: Path) -> None:
    kind, file = corruption[0], folder / corruption[1]
    if not file.is_file() and kind not in ("junk", "json"):  # deleted by an earlier corruption
        return
    if kind == "delete":
        file.unlink(missing_ok=True)
    elif kind == "truncate":
        file.write_bytes(file.read_bytes()[: corruption[2]])
    elif kind == "flip":
        data = bytearray(file.read_bytes())
        for offset, mask in corruption[2]:
            if offset < len(data):
                data[offset] ^= mask
        file.write_bytes(bytes(data))
    elif kind == "junk":
        file.write_bytes(corruption[2])
    elif kind == "json":
        file.write_text(json.dumps(corruption[2]))
    else:  # retype / drop one key of the file's JSON object (if an earlier corruption left one)
        try:
            data = json.loads(file.read_bytes())
        except (OSError, ValueError):
            return
        if not isinstance(data, dict):
            return
        if kind == "retype":
            data[corruption[2]] = corruption[3]
        else:
            data.pop(corruption[2], None)
        file.write_text(json.dumps(data))


CHECKPOINT_SIZES = {name: (LLAMA / name).stat().st_size for name in CHECKPOINT_FILES}
checkpoint_corruptions = st.lists(
    st.one_of(file_corruptions(tuple(CHECKPOINT_FILES), CHECKPOINT_SIZES), json_corruptions(REQUIRED)),
    min_size=1,
    max_size=2,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corruptions=checkpoint_corruptions)
def test_a_corrupted_checkpoint_is_refused_in_one_line_or_verified(corruptions):
    with tempfile.TemporaryDirectory(prefix="cbverify-test-ckpt-") as tmp:
        folder = Path(tmp) / "ckpt"
        shutil.copytree(LLAMA, folder)
        for corruption in corruptions:
            apply(corruption, folder)
        assert_one_line_or_report([*CHEAP, "--model", str(folder)], f"checkpoint: {corruptions!r}"[:300])


PROMPT_ROWS = [json.loads(line) for line in (EXAMPLES / "prompts.jsonl").read_text().splitlines() if line.strip()]
RECIPE = yaml.safe_load((EXAMPLES / "grpo_recipe.yaml").read_text())


@st.composite
def prompt_files(draw) -> tuple[str, bytes]:
    """``(suffix, bytes)`` of a prompts file: the example's rows, reshaped or corrupted as drawn."""
    rows = [json.loads(json.dumps(r)) for r in PROMPT_ROWS]
    kind = draw(st.sampled_from(["row", "field", "message", "bytes", "empty", "as_json", "txt"]))
    if kind == "row":
        rows[draw(st.integers(0, len(rows) - 1))] = draw(json_values)
    elif kind == "field":
        rows[draw(st.integers(0, len(rows) - 1))]["prompt"] = draw(json_values)
    elif kind == "message":
        conversations = [r for r in rows if isinstance(r["prompt"], list)]
        message = draw(st.sampled_from(conversations))["prompt"][0]
        key = draw(st.sampled_from(["role", "content"]))
        if draw(st.booleans()):
            message.pop(key)
        else:
            message[key] = draw(json_values)
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    if kind == "empty":
        return ".jsonl", draw(st.sampled_from([b"", b"\n\n", b"   \n"]))
    if kind == "as_json":
        return ".json", json.dumps(draw(st.sampled_from([rows, {"prompt": [r["prompt"] for r in rows]}]))).encode()
    if kind == "txt":
        return ".txt", draw(st.one_of(st.binary(max_size=64), st.text(max_size=40).map(str.encode)))
    data = text.encode()
    if kind == "bytes":
        return ".jsonl", _damage(draw, data)
    return ".jsonl", data


def _damage(draw, data: bytes) -> bytes:
    """``data`` truncated, with bytes flipped, or replaced by binary junk."""
    how = draw(st.sampled_from(["truncate", "flip", "junk"]))
    if how == "truncate":
        return data[: draw(st.integers(0, len(data)))]
    if how == "junk":
        return draw(st.binary(max_size=128))
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        out[draw(st.integers(0, len(out) - 1))] ^= draw(st.integers(1, 255))
    return bytes(out)


@st.composite
def recipe_files(draw) -> tuple[str, bytes]:
    """``(suffix, bytes)`` of a GRPO recipe: the example's, with a key retyped, dropped or added, or its bytes
    damaged, as YAML or as JSON (JSON holds only GRPOConfig fields)."""
    recipe = dict(RECIPE)
    as_json = draw(st.booleans())
    if as_json:
        for key in ("model_name_or_path", "dataset_name", "use_peft"):
            recipe.pop(key)
    kind = draw(st.sampled_from(["retype", "drop", "unknown", "bytes", "top"]))
    if kind == "retype":
        recipe[draw(st.sampled_from(sorted(recipe)))] = draw(json_values)
    elif kind == "drop":
        recipe.pop(draw(st.sampled_from(sorted(recipe))))
    elif kind == "unknown":
        recipe[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
    elif kind == "top":
        recipe = draw(json_values)
    data = json.dumps(recipe).encode() if as_json else yaml.safe_dump(recipe).encode()
    return (".json" if as_json else ".yaml"), _damage(draw, data) if kind == "bytes" else data


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=prompt_files(), recipe=recipe_files(), which=st.sampled_from(["prompts", "recipe", "both"]))
def test_corrupted_prompts_and_recipes_are_refused_in_one_line_or_verified(prompts, recipe, which):
    with tempfile.TemporaryDirectory(prefix="cbverify-test-inputs-") as tmp:
        argv = [*CHEAP, "--model", "tiny-qwen3-chat"]
        if which in ("prompts", "both"):
            (Path(tmp) / f"p{prompts[0]}").write_bytes(prompts[1])
            argv += ["--prompts", str(Path(tmp) / f"p{prompts[0]}")]
        if which in ("recipe", "both"):
            (Path(tmp) / f"r{recipe[0]}").write_bytes(recipe[1])
            argv += ["--grpo-config", str(Path(tmp) / f"r{recipe[0]}")]
        assert_one_line_or_report(argv, f"{which}: {prompts!r} {recipe!r}"[:300])


def test_the_example_inputs_and_the_untouched_checkpoint_verify():
    """The properties' starting points are valid: what they refuse is the corruption, not the baseline."""
    assert assert_one_line_or_report([*CHEAP, "--model", str(LLAMA)], "baseline checkpoint") == 0
    argv = [*CHEAP, "--model", "tiny-qwen3-chat", "--prompts", str(EXAMPLES / "prompts.jsonl"), "--grpo-config",
            str(EXAMPLES / "grpo_recipe.yaml")]  # fmt: skip
    assert assert_one_line_or_report(argv, "baseline inputs") == 0


def test_a_truncated_safetensors_file_is_named_in_one_line(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(LLAMA, folder)
    weights = folder / "model.safetensors"
    for size in (4, 1000, weights.stat().st_size - 1):
        weights.write_bytes((LLAMA / "model.safetensors").read_bytes()[:size])
        code, _, err = run_cli([*CHEAP, "--model", str(folder)])
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "model.safetensors" in err and ("truncated" in err or "data bytes" in err), err


@pytest.mark.parametrize(
    "argv",
    [["train", "--model", "BAD"], ["fuzz", "--model", "BAD"], ["bench", "--model", "BAD"],
     ["conformance", "--engines", "cb_impl", "--model", "BAD"], ["bench", "--grpo-model", "BAD"],
     ["bench", "--out", "FILE"],
     ["zoo", "--archs", "--combinations", "no-such-family"], ["golden", "check", "--case", "no-such-case"],
     ["golden", "check", "--engine", "no-such-engine"],
     ["train", "--min-terms", "5", "--max-terms", "3"], ["train", "--model", "tiny-qwen3-chat"],
     ["fuzz", "--engine", "cb_impl", "--entry", "generate_batch"], ["verify", "--json", "MISSING/r.json"],
     ["verify", "--engines", "no-such-engine"], ["verify", "--prompts", "FILE"], ["verify", "--grpo-config", "FILE"]],
    ids=lambda argv: " ".join(argv),
)  # fmt: skip
def test_every_subcommand_refuses_a_bad_checkpoint_or_path_in_one_line_before_any_work(tmp_path, argv):
    folder = tmp_path / "ckpt"
    shutil.copytree(LLAMA, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a truncated download
    (tmp_path / "f.txt").write_bytes(b"\x00\x01binary")
    (tmp_path / "f.yaml").write_bytes(b"\xff\xfe")
    paths = {"BAD": str(folder), "FILE": str(tmp_path / "f.txt"), "MISSING/r.json": str(tmp_path / "no" / "r.json")}
    if argv[-2:] == ["--grpo-config", "FILE"]:
        paths["FILE"] = str(tmp_path / "f.yaml")
    code, out, err = run_cli([paths.get(a, a) for a in argv])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"cbverify {argv[0]}: error: "), (code, lines, out)


# --- flag bounds ---------------------------------------------------------------------------------------------------

# (subcommand argv, flag, accepted bound, refused value one step past it)
BOUNDS = [
    (["verify"], "--num-prompts", "1", "0"), (["verify"], "--group-size", "1", "0"),
    (["verify"], "--max-new-tokens", "1", "0"), (["verify"], "--seed", "0", "-1"),
    (["verify"], "--seed", "4294967295", "4294967296"), (["verify"], "--dist-samples", "0", "-1"),
    (["verify"], "--dist-samples", "50", "49"), (["verify"], "--threads", "1", "0"),
    (["verify"], "--threads", "1024", "1025"),
    (["golden", "check"], "--threads", "1", "0"), (["golden", "record"], "--threads", "1024", "1025"),
    (["zoo"], "--threads", "1", "0"),
    (["fuzz"], "--examples", "1", "0"), (["fuzz"], "--seed", "0", "-1"), (["fuzz"], "--shrink-runs", "0", "-1"),
    (["bench"], "--n", "1", "0"), (["bench"], "--rounds", "1", "0"), (["bench"], "--threads", "1", "0"),
    (["bench"], "--kv-headroom", "1e-9", "0"), (["bench"], "--max-batch-tokens", "1", "0"),
    (["bench"], "--temperature", "0", "-1e-9"), (["bench"], "--seed", "0", "-1"), (["bench"], "--grpo-n", "2", "1"),
    (["bench"], "--grpo-steps", "2", "1"), (["bench"], "--grpo-rounds", "1", "0"),
    (["bench"], "--case-timeout", "0", "-1e-9"), (["bench"], "--time-budget", "0", "-1e-9"),
    (["train"], "--steps", "1", "0"), (["train"], "--num-prompts", "1", "0"),
    (["train"], "--num-generations", "1", "0"), (["train"], "--min-terms", "2", "1"),
    (["train"], "--max-terms", "2", "1"), (["train"], "--max-new-tokens", "1", "0"),
    (["train"], "--temperature", "1e-9", "0"), (["train"], "--learning-rate", "1e-9", "0"),
    (["train"], "--max-grad-norm", "1e-9", "0"), (["train"], "--num-iterations", "1", "0"),
    (["train"], "--epsilon", "0", "-1e-9"), (["train"], "--epsilon-high", "0", "-1e-9"),
    (["train"], "--beta", "0", "-1e-9"), (["train"], "--is-clip-max", "1e-9", "0"), (["train"], "--seed", "0", "-1"),
    (["train"], "--threads", "1", "0"),
    (["conformance", "--engines", "cb_impl"], "--examples", "1", "0"),
    (["matrix"], "--fuzz", "0", "-1"), (["matrix"], "--jobs", "1", "0"), (["matrix"], "--jobs", "256", "257"),
    (["matrix"], "--timeout", "1", "0"), (["upstream"], "--nproc", "1", "0"), (["upstream"], "--nproc", "64", "65"),
    (["fuzz"], "--shards", "1", "0"), (["fuzz"], "--shards", "4096", "4097"),
]  # fmt: skip
NOT_FINITE = [(["verify"], "--num-prompts", "x"), (["bench"], "--kv-headroom", "nan"), (["bench"], "--temperature",
              "inf"), (["train"], "--temperature", "nan"), (["train"], "--beta", "inf"),
              (["bench"], "--case-timeout", "inf"), (["bench"], "--time-budget", "nan")]  # fmt: skip


@pytest.mark.parametrize(("command", "flag", "bound", "past"), BOUNDS, ids=[f"{c[0]}{f}={b}" for c, f, b, _ in BOUNDS])
def test_each_numeric_flag_accepts_its_bound_and_refuses_one_step_past_it(command, flag, bound, past):
    value = getattr(build_parser().parse_args([*command, flag, bound]), flag.lstrip("-").replace("-", "_"))
    value = value[0] if isinstance(value, list) else value  # --n / --grpo-n take several
    assert value == (int(bound) if isinstance(value, int) else float(bound))
    code, out, err = run_cli([*command, flag, past])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and flag in lines[0] and not out, (code, lines)


@pytest.mark.parametrize(("command", "flag", "value"), NOT_FINITE)
def test_numeric_flags_refuse_words_and_non_finite_numbers(command, flag, value):
    code, _, err = run_cli([*command, flag, value])
    assert code == 2 and len(err.strip().splitlines()) == 1 and flag in err, err


def test_every_numeric_flag_of_the_owned_subcommands_has_a_bounds_case():
    """A new ``type=int`` / ``type=float`` flag without a range (or without a case above) fails here."""
    sub = build_parser()._subparsers._group_actions[0]
    covered = {(c[0], f) for c, f, _, _ in BOUNDS}
    missing = []
    for name in ("verify", "golden", "zoo", "fuzz", "bench", "train", "conformance", "matrix", "upstream"):
        parsers = [sub.choices[name]]
        if name == "golden":
            parsers = list(next(a for a in parsers[0]._actions if a.choices and "check" in a.choices).choices.values())
        for p in parsers:
            for action in p._actions:
                if action.type in (int, float):
                    missing.append(f"{name} {action.option_strings[0]}: plain {action.type.__name__}, no range")
                elif getattr(action.type, "__name__", "") in ("integer", "number", "dist_samples"):
                    if (name, action.option_strings[0]) not in covered:
                        missing.append(f"{name} {action.option_strings[0]}: no bounds case")
    assert not missing, missing


def test_the_verify_bounds_run_end_to_end():
    """The lowest values verify accepts, together, give a report (not a crash deeper in)."""
    argv = ["verify", "--engines", "reference", "--num-prompts", "1", "--group-size", "1", "--max-new-tokens", "1",
            "--dist-samples", "50", "--threads", "1", "--seed", "0", "--no-pressure"]  # fmt: skip
    assert assert_one_line_or_report(argv, "bounds") == 0


def test_parser_errors_are_one_line_and_main_returns_their_code():
    code, out, err = run_cli(["verify", "--dtype", "float8"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--dtype" in err and not out
    code, out, _ = run_cli(["--version"])
    assert code == 0 and out.startswith("cbverify ")


@pytest.mark.parametrize("trl", ["0.13.0", "0.4.0"])  # before the first GRPOTrainer
def test_matrix_refuses_a_trl_release_below_the_layers_floor_in_one_line(trl):
    """Nothing is built: the refusal comes before any venv, naming why those releases are out of reach."""
    code, out, err = run_cli(["matrix", "--trl", trl])
    assert "first release with a GRPOTrainer" in err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"trl {trl} is before" in lines[0] and not out, (code, out, lines)


def test_an_installer_that_cannot_be_honoured_is_refused_before_anything_is_built(monkeypatch):
    from cbverify import install

    monkeypatch.setenv("CBVERIFY_INSTALLER", "conda")
    code, out, err = run_cli(["matrix", "--trl", "1.8.0"])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "CBVERIFY_INSTALLER='conda'" in lines[0] and not out, (code, lines)
    monkeypatch.setenv("CBVERIFY_INSTALLER", "pip")
    assert install.installer() == "pip"
    assert install.command(Path("py"), "uninstall", "x")[-3:] == ["--quiet", "-y", "x"]
    monkeypatch.setenv("CBVERIFY_INSTALLER", "uv")
    monkeypatch.setattr(install, "uv_executable", lambda: None)
    with pytest.raises(ValueError, match="no uv executable"):
        install.installer()
