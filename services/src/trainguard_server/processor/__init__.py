"""Processor runtimes: move bytes and state around the pure pipeline (trainguard_engine.pipeline)."""
