"""NVML sampling in a background thread while the supervised command runs (gpu.csv)."""

from __future__ import annotations

import threading
from pathlib import Path

from ...errors import GPUUnavailableError
from ..monitor import CsvLog, nvml, sample_gpus


class GpuSampler:
    """Appends one row per GPU every ``interval_s`` to ``path``; remembers the peak used."""

    def __init__(self, path: Path, interval_s: float = 2.0) -> None:
        self.path = path
        self.interval_s = interval_s
        self.peak_used_bytes: dict[int, int] = {}
        self.note: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="oomless-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with nvml() as nv:
                log = CsvLog(self.path)
                try:
                    while not self._stop.is_set():
                        snap = sample_gpus(nv)
                        log.write(snap)
                        for g in snap.gpus:
                            self.peak_used_bytes[g.index] = max(
                                self.peak_used_bytes.get(g.index, 0), g.used_bytes)
                        self._stop.wait(self.interval_s)
                finally:
                    log.close()
        except GPUUnavailableError as err:
            self.note = f"GPU memory not sampled: {err}"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
