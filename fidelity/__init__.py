"""Fidelity: whether a variant still says what the control says, per request (compare.py), the
fingerprints of an answer (fingerprints.py), the control's answer scored under a vLLM
deployment by teacher forcing (scoring.py), and which of a mirror run's requests are scored and
the rows they give (scores.py)."""
