"""Uploaded traffic traces: stored under settings.TRACE_DIR by content hash, listed with their
figures, and the only files the API and the admin replay (Django glue over replay.sources)."""
