"""Every message format, read from real messages kept as fixtures."""

from __future__ import annotations

import pytest
from diagnose_fixtures import GiB, MiB, all_fixture_logs, as_bytes, read_fixture

from oomless.diagnose import diagnose_text
from oomless.diagnose.events import (
    BNB_OOM,
    CUDA_ERROR_OOM,
    CUDA_OOM,
    HOST_OOM,
    NCCL_OOM,
    PROCESS_KILLED,
    VLLM_FREE_MEMORY,
    VLLM_MAX_LEN,
    VLLM_NO_KV,
)
from oomless.diagnose.text import clean_line


def events_of(name: str):
    return [f.event for f in diagnose_text(read_fixture(name)).findings]


def only_event(name: str):
    events = events_of(name)
    assert len(events) == 1, [e.message for e in events]
    return events[0]


def test_pytorch2_message_with_a_process_listed_as_itself_inside_a_container():
    e = only_event("seed002_torch2.log")
    assert (e.kind, e.source, e.rank, e.device) == (CUDA_OOM, "pytorch-2.x", 0, 0)
    assert e.numbers["requested_bytes"] == as_bytes("6.56", "GiB")
    assert e.numbers["total_bytes"] == as_bytes("39.39", "GiB")
    assert e.numbers["free_bytes"] == as_bytes("3.18", "GiB")
    assert e.numbers["allocated_bytes"] == as_bytes("33.67", "GiB")
    assert e.numbers["reserved_unallocated_bytes"] == as_bytes("1.02", "GiB")
    assert e.numbers["reserved_bytes"] == as_bytes("33.67", "GiB") + as_bytes("1.02", "GiB")
    assert [(p.pid, p.memory_bytes) for p in e.processes] == [(1234, as_bytes("36.20", "GiB"))]
    assert all(isinstance(v, int) for k, v in e.numbers.items() if k.endswith("_bytes"))


def test_pytorch1_message_gives_the_same_numbers():
    e = only_event("seed002_torch1.log")
    assert e.source == "pytorch-1.x"
    assert e.numbers["requested_bytes"] == as_bytes("6.56", "GiB")
    assert e.numbers["reserved_bytes"] == as_bytes("34.69", "GiB")
    assert e.numbers["reserved_unallocated_bytes"] == as_bytes("34.69", "GiB") - as_bytes("33.67", "GiB")


def test_pytorch21_capacty_typo_and_this_process_line():
    e = only_event("torch21_capacty_eval_fragmentation.log")
    assert e.numbers["total_bytes"] == as_bytes("23.69", "GiB")
    assert e.numbers["requested_bytes"] == as_bytes("72.00", "MiB")
    assert [(p.is_self, p.memory_bytes) for p in e.processes] == [(True, as_bytes("23.66", "GiB"))]


def test_every_listed_process_is_read():
    e = only_event("torch2_other_processes.log")
    pids = [p.pid for p in e.processes if not p.is_self]
    assert pids == [644963, 644977, 2925282, 3053273, 3120922]
    assert sum(p.memory_bytes for p in e.processes if p.is_self) == as_bytes("3.14", "GiB")


def test_device_index_printed_as_a_nul_character():
    text = read_fixture("torch2_device_char_rank1.log")
    assert "GPU \x00 has" in text
    e = only_event("torch2_device_char_rank1.log")
    assert e.rank == 1 and e.device is None
    assert e.numbers["total_bytes"] == as_bytes("44.34", "GiB")


def test_oldest_wording_cached_and_a_message_wrapped_over_two_lines():
    e = only_event("torch1_cached_wrapped.log")
    assert e.numbers["total_bytes"] == as_bytes("3.81", "GiB")
    # before 1.5 "cached" was reserved minus allocated
    assert e.numbers["reserved_unallocated_bytes"] == as_bytes("9.78", "MiB")
    assert e.numbers["reserved_bytes"] == as_bytes("3.08", "GiB") + as_bytes("9.78", "MiB")


def test_memory_fraction_allowed_field():
    e = only_event("torch1_allowed.log")
    assert e.numbers["allowed_bytes"] == as_bytes("11.85", "GiB")
    assert e.numbers["free_bytes"] == as_bytes("12.60", "GiB")


def test_cuda_malloc_async_message_and_its_echo_are_one_event():
    e = only_event("malloc_async.log")
    assert e.source == "cuda-malloc-async" and e.occurrences == 2
    assert e.numbers["requested_bytes"] == as_bytes("640.00", "MiB")
    assert e.numbers["total_bytes"] == as_bytes("11.59", "GiB")
    assert e.numbers["free_bytes"] == as_bytes("7.12", "MiB")


def test_private_pool_variant():
    e = only_event("seed004_vllm_scoring.log")
    assert e.numbers["private_pool_bytes"] == as_bytes("512.00", "MiB")
    assert e.numbers["reserved_unallocated_bytes"] == as_bytes("1.02", "GiB")


def test_multi_rank_log_gives_one_event_per_rank():
    events = events_of("torch2_multirank_ddp_logits.log")
    assert sorted(e.rank for e in events) == [0, 1, 2, 3]
    assert {e.kind for e in events} == {CUDA_OOM}
    assert all(e.device == e.rank for e in events)


def test_cuda_error_and_bitsandbytes_kernel_error():
    assert only_event("deepspeed_zero3_init_cuda_error.log").kind == CUDA_ERROR_OOM
    e = only_event("bitsandbytes_kernel_error.log")
    assert (e.kind, e.source, e.numbers["source_line"]) == (BNB_OOM, "bitsandbytes", 380)


def test_bitsandbytes_in_a_rich_traceback():
    e = only_event("bitsandbytes_load_4bit.log")
    assert e.library == "bitsandbytes"
    assert e.numbers["total_bytes"] == as_bytes("14.75", "GiB")


def test_nccl_lines_of_one_failure_make_one_event():
    e = only_event("nccl_oom.log")
    assert (e.kind, e.rank, e.device) == (NCCL_OOM, 3, 3)
    assert e.numbers["requested_bytes"] == 10485760


@pytest.mark.parametrize("name, kind", [
    ("vllm_no_kv_cache.log", VLLM_NO_KV),
    ("vllm_max_len_v0.log", VLLM_MAX_LEN),
    ("vllm_max_len_v1.log", VLLM_MAX_LEN),
    ("vllm_free_memory.log", VLLM_FREE_MEMORY),
])
def test_vllm_messages(name, kind):
    e = only_event(name)
    assert (e.kind, e.source) == (kind, "vllm")


def test_vllm_numbers():
    v0 = only_event("vllm_max_len_v0.log").numbers
    assert (v0["max_model_len"], v0["kv_cache_tokens"]) == (32768, 4752)
    assert v0["profile_weights_bytes"] == round(12.43 * GiB)
    v1 = only_event("vllm_max_len_v1.log").numbers
    assert v1["kv_needed_bytes"] == as_bytes("6.30", "GiB")
    assert v1["estimated_max_model_len"] == 114432
    free = only_event("vllm_free_memory.log").numbers
    assert free["free_bytes"] == round(3.25 * GiB) and free["gpu_memory_utilization"] == 0.96
    no_kv = only_event("vllm_no_kv_cache.log").numbers
    assert no_kv["profile_kv_cache_bytes"] == round(-0.94 * GiB)


@pytest.mark.parametrize("name, kind, source", [
    ("host_kernel_oom.log", HOST_OOM, "kernel"),
    ("host_torchrun_sigkill_loading.log", PROCESS_KILLED, "torchrun"),
    ("host_dataloader_killed.log", HOST_OOM, "dataloader"),
    ("host_cpu_allocator.log", HOST_OOM, "pytorch-cpu"),
    ("host_slurm_oom.log", HOST_OOM, "scheduler"),
])
def test_host_memory_events(name, kind, source):
    e = only_event(name)
    assert (e.kind, e.source) == (kind, source)


def test_host_numbers():
    kernel = only_event("host_kernel_oom.log").numbers
    assert kernel["pid"] == 23817 and kernel["rss_bytes"] == 125829120 * 1024
    assert only_event("host_cpu_allocator.log").numbers["requested_bytes"] == 1048576000
    killed = only_event("host_torchrun_sigkill_loading.log")
    assert (killed.rank, killed.numbers["exit_code"], killed.numbers["pid"]) == (0, -9, 5120)


def test_launcher_kills_after_a_gpu_error_are_not_host_events():
    d = diagnose_text(read_fixture("seed002_torch2.log"))
    assert [f.event.kind for f in d.findings] == [CUDA_OOM]
    assert any("launcher" in n for n in d.notes)


def test_text_without_an_oom_finds_nothing():
    d = diagnose_text(read_fixture("no_oom_traceback.log"))
    assert not d.found
    assert d.to_dict()["summary"] == "no out-of-memory event found"


@pytest.mark.parametrize("name", [n for n in all_fixture_logs() if n != "no_oom_traceback.log"])
def test_every_fixture_has_an_event_with_its_line(name):
    text = read_fixture(name)
    events = events_of(name)
    assert events
    lines = text.splitlines()
    for e in events:
        assert 1 <= e.line <= len(lines)


@pytest.mark.parametrize("raw, text, rank, pid", [
    ("[rank3]: Traceback (most recent call last):", "Traceback (most recent call last):", 3, None),
    ("[default5]:  File \"x.py\", line 1, in f", " File \"x.py\", line 1, in f", 5, None),
    ("(VllmWorkerProcess pid=532) INFO 07-23 20:49:31 worker.py:241] Memory profiling takes 1 s",
     "Memory profiling takes 1 s", None, 532),
    ("\x1b[31mERROR 06-23 04:48:56 [core.py:519] ValueError: x\x1b[0m", "ValueError: x", None, None),
    ("[2024-04-22 10:12:03,112] [WARNING] [stage3.py:2160:step] 3 flushes", "3 flushes", None, None),
])
def test_prefixes_are_removed_and_ranks_kept(raw, text, rank, pid):
    line = clean_line(raw)
    assert (line.text, line.rank, line.pid) == (text, rank, pid)


def test_sizes_in_bytes_and_kib():
    text = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512 bytes. GPU 1 has a total "
            "capacity of 7.79 GiB of which 743.50 KiB is free. Of the allocated memory 7.01 GiB is "
            "allocated by PyTorch, and 18.00 MiB is reserved by PyTorch but unallocated.")
    e = diagnose_text(text).findings[0].event
    assert e.device == 1
    assert e.numbers["requested_bytes"] == 512
    assert e.numbers["free_bytes"] == as_bytes("743.50", "KiB")
    assert e.numbers["reserved_unallocated_bytes"] == 18 * MiB


@pytest.mark.parametrize("line, exit_code", [
    ("Killed", -9),  # bash, after SIGKILL of the foreground job
    ("./run.sh: line 3: 12345 Killed                  python train.py --bs 8", -9),
    ("Container exited with code 137", 137),
    ("subprocess.CalledProcessError: Command '['python', 'train.py']' died with <Signals.SIGKILL: 9>.", -9),
    ("[launch.py:322:sigkill_handler] ['python', '-u', 'train.py'] exits with return code = -9", -9),
])
def test_sigkill_reports_of_shells_and_launchers(line, exit_code):
    e = diagnose_text(line).findings[0].event
    assert (e.kind, e.numbers["exit_code"]) == (PROCESS_KILLED, exit_code)
    assert diagnose_text(line).findings[0].causes[0].code == "host_ram"


def test_the_word_killed_inside_a_sentence_is_not_an_event():
    assert not diagnose_text("This job was Killed at epoch 3 by the user").found
