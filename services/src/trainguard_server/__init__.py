"""TrainGuard backend: gateway → queue → processor → stores → query API (embedded in one process by
default)."""

__version__ = "0.1.0"
