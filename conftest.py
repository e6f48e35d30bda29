"""Shared pytest configuration: Hypothesis profiles, a --max-examples override, bundled-model fixtures, CUDA gate."""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, settings

from reference.models import BUNDLED

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
torch.set_num_threads(1)  # tiny models: one thread is faster than two (no OMP sync), and immune to a loaded machine

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("dev", max_examples=10, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "ci", max_examples=50, derandomize=True, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK
)
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=_SLOW_OK)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--max-examples", type=int, default=None, help="override Hypothesis max_examples for this run")


def pytest_terminal_summary(terminalreporter) -> None:
    """Print what tests measured without asserting (``property_tests.helpers.SUMMARY``)."""
    helpers = sys.modules.get("property_tests.helpers")
    for line in getattr(helpers, "SUMMARY", []):
        terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    n = config.getoption("--max-examples")
    if n is not None:
        base = settings.get_profile(settings.get_current_profile_name())
        settings.register_profile("cli-override", base, max_examples=n)
        settings.load_profile("cli-override")


class LoadedModel(NamedTuple):
    model: object  # a transformers causal LM, float32, CPU, eval mode
    tokenizer: object


class BundledModel(NamedTuple):
    name: str
    model: object
    tokenizer: object


@pytest.fixture(scope="session")
def llama() -> LoadedModel:
    """The bundled trained arithmetic Llama (``tiny-llama-arith``) in float32 on CPU."""
    from reference.models import load

    return LoadedModel(*load("tiny-llama-arith"))


@pytest.fixture(scope="session")
def qwen2() -> LoadedModel:
    """The bundled random-weight Qwen2 (``tiny-qwen2-random``) in float32 on CPU."""
    from reference.models import load

    return LoadedModel(*load("tiny-qwen2-random"))


@pytest.fixture(scope="session", params=BUNDLED)
def bundled_model(request) -> BundledModel:
    """Each bundled model in turn (``reference.models.BUNDLED``). A Hypothesis property over it shares one budget
    among them: :func:`per_model_examples`."""
    from reference.models import load

    return BundledModel(request.param, *load(request.param))


def per_model_examples(models: int) -> int:
    """Examples per bundled model for a property whose budget is ``models`` times the loaded profile's examples
    (the ``--max-examples`` override included), shared among every bundled model: the sum over them never exceeds
    that budget, and each model gets at least one."""
    return max(1, models * settings.default.max_examples // len(BUNDLED))
