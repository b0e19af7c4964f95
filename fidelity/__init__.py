"""Fidelity: whether a variant still says what the control says, per request (compare.py)."""
