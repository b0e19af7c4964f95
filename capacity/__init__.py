"""SLA capacity: the highest load each variant serves within the SLA, and what it costs there.

``search`` is the pure search (bracketing, bisection, the sequential step verdict, cost);
``steps`` runs one step as a replay; ``service`` searches an experiment's variants and stores
the result; the ``capacity`` command is the way in (docs/capacity.md).
"""
