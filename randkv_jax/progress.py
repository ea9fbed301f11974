"""A progress display for long runs: requests done / running / queued, tokens/s, ETA (tqdm on stderr)."""

from __future__ import annotations

from tqdm import tqdm

from randkv_jax.engine import Progress


class ProgressBar:
    """`with ProgressBar(total_requests) as bar: engine.run(progress=bar.update)`.

    The bar counts completed requests (tqdm's rate and ETA are per request); the postfix shows the
    running and queued requests and the generated tokens per second of wall time.
    """

    def __init__(self, total: int, desc: str = "requests"):
        self._bar = tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True)
        self.note = ""
        """Shown after the counts (e.g. a running accuracy)."""

    def update(self, progress: Progress) -> None:
        self._bar.update(progress.completed - self._bar.n)
        note = f", {self.note}" if self.note else ""
        self._bar.set_postfix_str(
            f"running {progress.running}, queued {progress.queued}, {progress.tokens_per_second:.1f} tok/s{note}"
        )

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
