"""``oomless run``: supervise a training command people already have (torch-free).

One run folder holds everything: ``events.jsonl`` (what the supervisor and
the protected Trainers did), ``memlog.jsonl`` (per step, from the protected
Trainer), ``attempt-N.log`` (the command's output, also shown live; capped,
the older part in ``attempt-N.log.1``: see child.py),
``gpu.csv`` (NVML samples), ``configs/attempt-N/`` (edited copies of the
configuration), ``shim/`` (the sitecustomize that protects the Trainers)
and ``report.html``.
"""

from .supervisor import RunOptions, RunResult, supervise

__all__ = ["RunOptions", "RunResult", "supervise"]
