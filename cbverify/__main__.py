"""``python -m cbverify ...``: the same as the ``cbverify`` command (the matrix runs it in each version's venv)."""

from cbverify.cli import main

raise SystemExit(main())
