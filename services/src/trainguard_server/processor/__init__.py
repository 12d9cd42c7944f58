"""Processor runtimes: move bytes and state around the pure pipeline (trainguard.core.pipeline)."""
