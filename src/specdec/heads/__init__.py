"""Draft heads trained against a target's hidden states (EAGLE-3, Medusa, parallel): the
modules (:mod:`.modules`) and their on-disk format (:mod:`.format`). The drafters that use
them are :mod:`specdec.drafters.eagle`, :mod:`specdec.drafters.medusa` and
:mod:`specdec.drafters.parallel`; training is
:mod:`specdec.training`."""
