"""Placeholder until the quantizers land (being written now)."""
QUANTIZERS: dict = {}
