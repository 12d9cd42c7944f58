"""The query API (FastAPI): runs, metrics, incidents, clusters, search, health and Prometheus metrics."""
