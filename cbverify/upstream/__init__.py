"""Upstream checks: TRL's real ``GRPOTrainer`` / ``RLOOTrainer`` driven offline, observed, and judged.

One run, module by module::

    scenario  ->  run  ->  capture  ->  checks / numerics / sampler_checks  ->  suite (judge against findings)
    what to     build and    what the      invariants, each      PASS / NOT-APPLICABLE / XFAIL(finding) /
    train       train TRL    trainer saw   a CheckResult         FAIL (unregistered) / FIXED? (registered, passes)

- :mod:`.scenario`: :class:`~.scenario.TrainerScenario`, one drawn trainer configuration, and ``build_trainer``.
- :mod:`.run`: ``run_scenario`` trains a copy of the model under a scenario on one generation path (``generate``,
  ``cb`` = transformers continuous batching, ``rollout_func`` backed by :mod:`.rollout`); ``not_applicable`` says
  why a scenario cannot run on the installed versions.
- :mod:`.capture`: wraps trainer methods *on the instance* (TRL is never edited) and records what it generated,
  scored and lost (:class:`~.capture.Capture`).
- :mod:`.checks` (structure: alignment, state left behind, RNG, modes), :mod:`.numerics` (the trainer's log-probs,
  advantages, loss and gradient against ``reference``) and :mod:`.sampler_checks` (the sampler's tokens, log-prob
  semantics and importance-sampling weights): functions ``(scenario, capture, ...) -> list[CheckResult]``.
- :mod:`.findings`: the registry of known upstream behaviours, each with evidence, versions and a repro; a
  registered failure is an XFAIL, an unregistered one a FAIL, a registered one that passes again ``FIXED?``.
- :mod:`.suite`: the default scenarios, ``check_scenario`` and ``judge``; :mod:`.matrix` runs it all in one cached
  venv per transformers / trl version (``cbverify matrix``).
"""
