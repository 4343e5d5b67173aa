"""Host-memory out-of-memory events: the kernel's OOM killer and what launchers report.

Formats:

- Linux (mm/oom_kill.c): "Out of memory: Killed process 1234 (python)
  total-vm:…kB, anon-rss:…kB, …"; before 5.x "Out of memory: Kill process 1234
  (python) score 953 or sacrifice child"; cgroups: "Memory cgroup out of
  memory: Killed process …".
- PyTorch CPU allocator (c10/core/impl/alloc_cpu.cpp): "DefaultCPUAllocator:
  not enough memory: you tried to allocate N bytes."
- DataLoader (torch/utils/data/_utils/signal_handling.py): "DataLoader worker
  (pid 1234) is killed by signal: Killed."
- torchrun (torch/distributed/elastic): "failed (exitcode: -9) local_rank: 0
  (pid: 1234)" and the ChildFailedError summary "rank : 3 (local_rank: 3) /
  exitcode : -9 (pid: 1234) / traceback : Signal 9 (SIGKILL) received by PID".
- DeepSpeed launcher: "… exits with return code = -9"; subprocess: "died with
  <Signals.SIGKILL: 9>"; bash: a line "Killed" or "line 3: 1234 Killed …";
  slurm: "Detected 1 oom_kill event", "Some of the step tasks have been OOM
  Killed"; Kubernetes: "Reason: OOMKilled"; exit code 137 (128 + SIGKILL).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from .events import HOST_OOM, PROCESS_KILLED, OomEvent
from .text import LogText, scan, squeeze

KERNEL = re.compile(
    r"(?:Memory cgroup )?[Oo]ut of memory: Kill(?:ed)? process (?P<pid>\d+) \((?P<name>[^)\n]{0,64})\)"
    r"(?:[^\n]{0,40}?total-vm:(?P<vm>\d+)kB, anon-rss:(?P<rss>\d+)kB)?"
)
CPU_ALLOCATOR = re.compile(
    r"DefaultCPUAllocator: (?:not enough memory|can't allocate memory): you tried to allocate (?P<req>\d+) bytes"
)
DATALOADER = re.compile(r"DataLoader worker \(pid\(?s?\)? ?(?P<pid>[\d, ]+)\)? is killed by signal: Killed")
TORCHRUN_FAILED = re.compile(r"failed \(exitcode: (?P<code>-9|137)\) local_rank: (?P<rank>\d+) \(pid: (?P<pid>\d+)\)")
CHILD_FAILED = re.compile(
    r"rank\s*:\s*(?P<rank>\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(?P<code>-9|137) \(pid: (?P<pid>\d+)\)"
)
SIGKILL = re.compile(
    r"exits with return code = (?P<code>-9|137)\b|died with <Signals\.SIGKILL: 9>"
    r"|(?m:^[^\n]{0,80}line \d+:\s+(?P<pid>\d+) Killed\s+\S[^\n]*$)|(?m:^\s*Killed\s*$)"
    r"|(?:exit(?:ed)?(?: with)? (?:code|status)|Exit Code:)\s*(?P<code137>137)\b"
)
CLUSTER_KILL = re.compile(  # one event per line, however many of the phrases it holds
    r"(?m)^[^\n]{0,200}?(?:Detected \d+ oom[-_]kill events?|have been OOM Killed|Exceeded job memory limit"
    r"|\bOOMKilled\b|task \d+: Out Of Memory)[^\n]{0,200}"
)


def _event(log: LogText, m: re.Match[str], kind: str, source: str, **fields) -> OomEvent:
    index = log.line_index(m.start())
    rank = fields.pop("rank", None)
    return OomEvent(kind=kind, source=source, line=index + 1, message=squeeze(m.group(0)),
                    rank=log.rank_at(index) if rank is None else rank, **fields)


def _pid(text: str | None) -> dict[str, int | float]:
    digits = re.findall(r"\d+", text or "")
    return {"pid": int(digits[0])} if digits else {}


def _matches(pattern: re.Pattern[str], text: str, *words: str) -> Iterator[re.Match[str]]:
    """``pattern``'s matches near one of ``words`` (see :func:`.text.scan`)."""
    yield from scan(pattern, text, words)


def _kernel(log: LogText) -> Iterator[OomEvent]:
    for m in _matches(KERNEL, log.text, "ut of memory: Kill"):
        numbers = _pid(m.group("pid"))
        if m.group("rss"):
            numbers["rss_bytes"] = int(m.group("rss")) * 1024  # the kernel's kB are KiB
            numbers["virtual_bytes"] = int(m.group("vm")) * 1024
        yield _event(log, m, HOST_OOM, "kernel", numbers=numbers)
    for m in _matches(CPU_ALLOCATOR, log.text, "DefaultCPUAllocator"):
        yield _event(log, m, HOST_OOM, "pytorch-cpu", numbers={"requested_bytes": int(m.group("req"))})
    for m in _matches(DATALOADER, log.text, "DataLoader worker"):
        yield _event(log, m, HOST_OOM, "dataloader", numbers=_pid(m.group("pid")), phase="data_loading")
    for m in _matches(CLUSTER_KILL, log.text, "oom", "OOM", "memory limit", "Out Of Memory"):
        yield _event(log, m, HOST_OOM, "scheduler")


def _kills(log: LogText) -> Iterator[OomEvent]:
    for m in _matches(TORCHRUN_FAILED, log.text, "exitcode"):
        numbers = {**_pid(m.group("pid")), "exit_code": int(m.group("code"))}
        yield _event(log, m, PROCESS_KILLED, "torchrun", numbers=numbers, rank=int(m.group("rank")))
    for m in _matches(CHILD_FAILED, log.text, "exitcode"):
        numbers = {**_pid(m.group("pid")), "exit_code": int(m.group("code"))}
        yield _event(log, m, PROCESS_KILLED, "torchrun", numbers=numbers, rank=int(m.group("rank")))
    for m in _matches(SIGKILL, log.text, "Killed", "return code", "SIGKILL", "137"):
        code = m.group("code") or m.group("code137")
        numbers = _pid(m.group("pid"))
        numbers["exit_code"] = int(code) if code else -9
        yield _event(log, m, PROCESS_KILLED, "launcher", numbers=numbers)


def find_host_events(log: LogText) -> list[OomEvent]:
    """Host OOM events; kills already explained by a kernel line (same pid) are dropped."""
    kernel = list(_kernel(log))
    killed_pids = {e.numbers.get("pid") for e in kernel if "pid" in e.numbers}
    kills: list[OomEvent] = []
    seen_pids: set[int | float] = set()
    for event in _kills(log):
        pid = event.numbers.get("pid")
        if pid is not None and (pid in killed_pids or pid in seen_pids):
            continue
        if pid is not None:
            seen_pids.add(pid)
        kills.append(event)
    return kernel + kills
