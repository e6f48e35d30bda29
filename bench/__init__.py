"""Side-by-side rollout benchmarks: transformers ``generate()`` (TRL's default path), transformers continuous batching
(TRL's ``use_transformers_continuous_batching``), and our ``cb_impl``; plus TRL ``GRPOTrainer`` step timings.

Entry points: ``cbverify bench`` (``cbverify/bench_cmd.py``) and ``pytest -m bench`` (``bench/test_bench_*.py``).
See ``bench/README.md`` for workloads, metrics and how each engine is made to stop.
"""
