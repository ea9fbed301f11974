"""The budget rule as plain Python, for tests: what a row holds, step by step (not the library's code)."""

from __future__ import annotations


def simulate_fill(policy, prompt_len: int, steps: int):
    """Entries a row holds under the budget rule after `steps` generated tokens are written:
    (final fill, peak, rounds, generated count at the last round or None)."""
    fill = peak = prompt_len
    rounds, last = 0, None
    for generated in range(1, steps + 1):
        fill += 1
        peak = max(peak, fill)
        if generated % policy.interval == 0 and fill > policy.budget:
            fill, rounds, last = policy.budget, rounds + 1, generated
    return fill, peak, rounds, last
