"""Test support: cached heavy fixtures (see nvsrc.py)."""
