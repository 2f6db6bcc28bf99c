"""Benchmarks (not tests): `cosine bench ...`."""
