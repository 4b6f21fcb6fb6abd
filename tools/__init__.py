"""What is not the algorithm: the recipe comparison (compare.py), its figures and tables (plot.py)
and the 3-way log-prob audit (audit.py). Each runs as `python -m tools.NAME --help`; nothing in the
concept modules imports from here."""
