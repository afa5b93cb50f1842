"""The benchmark bodies, one module per area; bench/kvbench.py runs them (`--list`)."""
