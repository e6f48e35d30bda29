"""pytest-benchmark timings of the three engines on the gsm8k-like workload (``pytest -m bench``; ``make bench`` saves
JSON under ``bench-results/pytest`` and ``--benchmark-compare`` compares against the last saved run).

Device from ``CBVERIFY_BENCH_DEVICE`` (default ``cpu``; ``cuda`` uses bf16 and the Llama-3.2-1B-shaped random
model). Timings are recorded, never asserted: each round's outputs are checked instead (count, per-request
lengths, finish reasons), and tokens/s, KV bytes and wasted share go into ``extra_info``.
"""

from __future__ import annotations

import os

import pytest
import torch

from cbverify.bench import measure
from cbverify.bench.models import RANDOM, load_bench_model
from cbverify.bench.timed import ENGINES, EngineOptions, run_engine
from cbverify.bench.workloads import kv_budget_tokens, make_requests, make_workload

DEVICE = os.environ.get("CBVERIFY_BENCH_DEVICE", "cpu")
pytestmark = pytest.mark.bench


@pytest.fixture(scope="module")
def bench_model():
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.fail(f"CBVERIFY_BENCH_DEVICE={DEVICE} but CUDA is not available")
    return load_bench_model(RANDOM, device=DEVICE)


@pytest.mark.parametrize("n", [8, 32])
@pytest.mark.parametrize("engine", ENGINES)
def test_engine_throughput_on_the_gsm8k_like_workload(benchmark, bench_model, engine: str, n: int):
    model, info = bench_model
    workload = make_workload("gsm8k-like", n, device=DEVICE)
    requests = make_requests(workload, vocab_size=info["vocab_size"])
    budget = kv_budget_tokens(workload, requests, headroom=1.25)
    opts = EngineOptions(device=DEVICE, num_blocks=-(-budget // 16), max_batch_tokens=512, time_forwards=False)
    runs = []
    benchmark.group = f"gsm8k-like N={n} ({DEVICE})"
    benchmark.pedantic(lambda: runs.append(run_engine(engine, model, requests, opts)), rounds=2, iterations=1,
                       warmup_rounds=1)  # fmt: skip
    last = runs[-1]
    for run in runs:
        assert [len(c) for c in run.completions] == [r.sampling.max_new_tokens for r in requests]
        assert set(run.finish_reasons) == {"length"}
    tokens = sum(len(c) for c in last.completions)
    necessary = measure.necessary_tokens(requests, [len(c) for c in last.completions])
    benchmark.extra_info.update(model=info, completion_tokens=tokens, tokens_per_s=tokens / last.wall_s,
                                kv_reserved_bytes=last.kv_reserved_bytes, env=measure.environment(DEVICE),
                                wasted_share=measure.wasted_share(necessary, last.forward_tokens))  # fmt: skip
