"""Progress of long commands (demo, bench) on stderr: a tqdm bar per step when tqdm is
installed and stderr is a terminal, else one plain line per update (logs, CI, pipes)."""
from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(self, command: str, stream: TextIO | None = None, bars: bool | None = None):
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        if bars is None:
            bars = self.stream.isatty() and _have_tqdm()
        self._bars: dict[str, object] | None = {} if bars else None

    def update(self, label: str, done: int, total: int, unit: str = "sizes") -> None:
        """``done`` of ``total`` steps of ``label`` (e.g. "all_gather") are finished."""
        if self._bars is None:
            print(f"{self.command}: {label} {done}/{total} {unit}", file=self.stream,
                  flush=True)
            return
        from tqdm import tqdm
        bar = self._bars.get(label)
        if bar is None:
            bar = self._bars[label] = tqdm(total=total, desc=f"{self.command} {label}",
                                           unit=unit.rstrip("s"), file=self.stream,
                                           leave=True, dynamic_ncols=True)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    def __call__(self, rank: int, item) -> None:
        """As the ``progress`` callback of :func:`sparkccl.localrun.run_ranks`: items are
        ``(label, done, total)`` tuples."""
        self.update(*item)

    def close(self) -> None:
        for bar in (self._bars or {}).values():
            bar.close()


def _have_tqdm() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True
