"""Side-by-side rollout benchmarks: transformers ``generate()`` (TRL's default path), transformers continuous batching
(TRL's ``use_transformers_continuous_batching``), and our ``cb_impl``; plus TRL ``GRPOTrainer`` step timings.

Every engine is driven through its one adapter in :mod:`cbverify.engines`; this package only times it. Entry points:
``cbverify bench`` (:mod:`cbverify.cli.bench`) and ``pytest -m bench`` (``bench/test_bench_*.py``). See
``bench/README.md`` for workloads, metrics and how each engine is made to stop; results live in ``bench/results/``.
"""
