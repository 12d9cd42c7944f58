"""Stores behind small interfaces: raw context (EventStore), metrics (MetricStore), incidents, clusters,
runs and processor state (IncidentStore), projects and tokens (ProjectStore)."""
