"""Integrations hook the SDK into Python, torch and trainers. Each refuses cleanly (DidNotEnable) when the
library it needs is missing, and undoes what it changed in ``teardown()``."""
