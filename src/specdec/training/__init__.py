"""Training draft heads against a target (issue 19, in progress): so far only the check
that training text never overlaps the benchmark test sets (:mod:`.contamination`)."""
