"""Fidelity: whether a variant still says what the control says, per request (compare.py), the
fingerprints of an answer (fingerprints.py), and the control's answer scored under a vLLM
deployment by teacher forcing (scoring.py)."""
