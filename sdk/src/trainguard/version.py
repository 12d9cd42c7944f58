"""The SDK's name and version, as sent in every envelope's ``sdk`` field."""

SDK_NAME = "trainguard-python"
__version__ = "0.1.0"
