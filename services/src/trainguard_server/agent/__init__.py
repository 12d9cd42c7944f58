"""Sidecar agent."""
