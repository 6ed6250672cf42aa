"""Draft heads trained against a target's hidden states (EAGLE-3, Medusa): the modules
(:mod:`.modules`) and their on-disk format (:mod:`.format`). The drafters that use them
are :mod:`specdec.drafters.eagle` and :mod:`specdec.drafters.medusa`; training is
:mod:`specdec.training`."""
