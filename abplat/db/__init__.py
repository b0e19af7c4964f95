"""abplat's own database backends, named by their package in DATABASES (abplat/config.py)."""
