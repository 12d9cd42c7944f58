"""The SDK's wire-level core, shared with the engine: envelopes and the JSON mapping (:mod:`.events`) and
stack fingerprints, of live exceptions (:mod:`.fingerprint`) and of printed tracebacks
(:mod:`.tracebacks`, the same hash). Pure: no I/O, no threads, no globals. Detection lives in the
separate distribution ``trainguard-engine`` (``trainguard_engine``), which the training process never
loads."""
