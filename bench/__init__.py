"""Benchmarks and long-running checks of Intermission against the real servers (not shipped with the product)."""
