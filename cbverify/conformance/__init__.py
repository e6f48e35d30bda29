"""The conformance suite: the cross-engine properties as a pytest plugin any engine's own CI can run.

    pytest --pyargs cbverify.conformance --cbverify-engine mypkg.rollouts:make_engine [--cbverify-model PATH]
        [--cbverify-option key=value ...] [--cbverify-report conformance.md]

``plugin`` (registered with pytest's ``pytest11`` entry point, so it loads wherever cbverify is installed) adds the
options and the fixtures; ``test_conformance`` holds the properties, each parametrised by the engines given and
skipped, with the capability named, where the engine does not claim what the property checks; ``strategies`` draws
the requests. ``--cbverify-report`` writes the property x engine table (PASS / FAIL / NOT-APPLICABLE and why, the
versions, the command that reproduces a failure). The engine protocol is docs/engines.md.
"""
