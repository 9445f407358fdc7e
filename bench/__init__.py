"""Benchmarks: thin drivers over titan_draft's own functions, run from the repository root as
`python -m bench.<name>` (e.g. `python -m bench.rl_step --preset cpu`); each prints a table and writes JSON."""
