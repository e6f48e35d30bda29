"""Bundled checkpoints (``models/``, rebuilt by ``python -m golden.build_models``), golden records (``records/``) and
their tests; the record / check code is :mod:`cbverify.golden`."""
