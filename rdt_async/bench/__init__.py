"""Benchmarks: `python -m rdt_async.bench` (JSON out, ratios against baselines run alongside)."""
