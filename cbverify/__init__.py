"""cbverify: can I trust my continuous-batching rollouts? Harness, comparisons, reports and the CLI."""

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it; CHANGELOG.md says what changed)
