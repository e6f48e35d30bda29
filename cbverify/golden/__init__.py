"""Golden log-prob regression files: which cases exist (:mod:`.cases`), how a record is written (:mod:`.record`) and
checked (:mod:`.check`), the environment stamped into it (:mod:`.env`), and the noise measurement behind the golden
tolerances (:mod:`.measure_noise`). Records live in ``golden/records/<device class>/``; ``cbverify golden`` drives it.
"""
