"""Ingest gateway: authenticates, validates and durably queues envelope batches.

* :mod:`.validate` — pure per-envelope rules (and a batch fast path that gives the same answers);
* :mod:`.ingest` — the transport-independent core (:class:`~.ingest.Gateway`);
* :mod:`.http` — ``POST /v1/ingest`` as a FastAPI router; :mod:`.grpc` — ``trainguard.v1.IngestService``.
"""
