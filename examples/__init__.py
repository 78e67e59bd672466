"""Runnable examples (python -m examples.NAME from the repository root)."""
