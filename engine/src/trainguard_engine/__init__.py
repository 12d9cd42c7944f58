"""TrainGuard's detection engine: the pure pipeline, its detectors, the classifier and the catalogue.

Pure logic shared by the embedded runtime and the Flink job: no I/O, no threads, no globals. It reads the
SDK's wire schema (``trainguard.core.events``, ``trainguard.core.fingerprint``, ``trainguard.v1``) and
nothing else of the SDK; the SDK never imports it (tests/test_layers.py). See docs/architecture.md.
"""

from . import _native

_native.activate(__path__)  # the compiled hot modules first, when built from these sources (_native.py)
