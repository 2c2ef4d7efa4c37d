"""Shared test factories (import as ``tests.helpers.<module>``)."""
