"""Benchmarks, probes and reports (arrive with their issues)."""
