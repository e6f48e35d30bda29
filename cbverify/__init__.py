"""cbverify: can I trust my continuous-batching rollouts? Harness, comparisons, reports and the CLI."""
