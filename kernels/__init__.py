"""Pallas kernels (per-head random top-K eviction arrives with the kernel issue)."""
