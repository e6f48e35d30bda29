"""The architecture zoo: tiny random-weight checkpoints of many transformers architectures, every engine run on each.

- :mod:`.architectures`: one :class:`~.architectures.Arch` per architecture (config factory, features exercised),
  ``build`` / ``load`` into a folder, weights made discriminating;
- :mod:`.matrix`: each engine on each architecture, judged against the oracle as ``cbverify verify`` judges;
- :mod:`.findings`: upstream failures registered per architecture (strict: a fixed one fails the zoo test).

``cbverify zoo --markdown docs/coverage.md`` regenerates the coverage table.
"""

from cbverify.zoo.architectures import ARCHS, SEED, WINDOW, Arch, build, by_name, load

__all__ = ["ARCHS", "SEED", "WINDOW", "Arch", "build", "by_name", "load"]
