"""Shared test factories (importable as `support` from any test: see pyproject's pytest pythonpath)."""
