"""GPU catalog and --gpu parsing."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomless.errors import UnknownGPUError
from oomless.models.hardware import close_gpus, get_gpu, gpu_catalog, parse_gpu_arg

REQUIRED = [
    "t4", "v100-16gb", "v100-32gb", "a10", "a10g", "l4", "l40s", "rtx-3090", "rtx-4090",
    "rtx-5090", "rtx-a6000", "a100-40gb", "a100-40gb-pcie", "a100-80gb", "a100-80gb-pcie",
    "h100-pcie", "h100-sxm", "h200", "b200",
    # issue 12
    "rtx-2080-ti", "rtx-3060", "rtx-4060-ti-16gb", "rtx-4070", "rtx-4080", "a40", "a800-40gb",
    "l20",
]


def test_catalog_has_the_required_gpus():
    catalog = gpu_catalog()
    assert len(catalog) >= 32
    assert set(REQUIRED) <= set(catalog)


# Totals as torch's OOM message printed them on these cards (2 decimals, GiB), from
# the issues each entry's source names.
@pytest.mark.parametrize(
    ("name", "printed_gib"),
    [("rtx-2080-ti", 10.76), ("rtx-3060", 11.76), ("rtx-4070-ti", 11.70),
     ("rtx-4080-super", 15.60), ("l20", 44.53), ("a30", 23.53), ("rtx-a4000", 15.61)],
)
def test_new_totals_equal_the_printed_oom_figures(name, printed_gib):
    gpu = get_gpu(name)
    assert round(gpu.memory_bytes / 2**30, 2) == printed_gib
    assert not gpu.memory_inferred and f"{printed_gib:.2f} GiB" in gpu.source


def test_inferred_totals_say_so_in_the_estimate():
    gpu = get_gpu("rtx-4080")
    assert gpu.memory_inferred and "inferred" in gpu.source.split("|")[0]
    assert any("not measured on this card" in a for a in gpu.assumptions)
    assert get_gpu("rtx-4090").assumptions == []


@pytest.mark.parametrize(
    ("name", "total_bytes"),
    [
        ("a100-80gb", 85_089_558_528),  # mem_get_info on A100-SXM4-80GB
        ("h100-sxm", 85_029_158_912),  # 81,090 MiB
        ("rtx-4090", 25_393_692_672),
    ],
)
def test_known_memory_totals(name, total_bytes):
    assert get_gpu(name).memory_bytes == total_bytes


def test_every_entry_is_plausible_and_sourced():
    raw = json.loads(resources.files("oomless.data").joinpath("gpus.json").read_text())
    names = [g["name"] for g in raw["gpus"]]
    assert len(names) == len(set(names))
    for gpu in gpu_catalog().values():
        assert "memory:" in gpu.source and "compute" in gpu.source, gpu.name
        assert 10 * 2**30 < gpu.memory_bytes < 200 * 2**30, gpu.name
        assert ("UNVERIFIED" in gpu.source) == gpu.specs_unverified, gpu.name
        assert gpu.interconnect in {"nvlink", "pcie"}
        assert gpu.pcie_gbs > 0 and gpu.interconnect_gbs > 0 and gpu.memory_bandwidth_gbs > 0
        assert gpu.fp16_tflops > 0
        # bf16 needs Ampere (8.0) or newer; cards without it carry 0 bf16 TFLOP/s
        assert gpu.bf16 == (float(gpu.compute_capability) >= 8.0)
        assert (gpu.bf16_tflops > 0) == gpu.bf16
        if gpu.interconnect == "nvlink":
            assert gpu.interconnect_gbs > gpu.pcie_gbs


def test_datacenter_ordering():
    # a sanity check on the data: newer generations are not slower or smaller
    assert get_gpu("h100").bf16_tflops > get_gpu("a100").bf16_tflops > get_gpu("v100").fp16_tflops
    assert get_gpu("b200").memory_bytes > get_gpu("h200").memory_bytes > get_gpu("h100").memory_bytes
    assert get_gpu("h200").memory_bandwidth_gbs > get_gpu("h100").memory_bandwidth_gbs


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4090", "rtx-4090"),
        ("RTX 4090", "rtx-4090"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("rtx4090", "rtx-4090"),
        ("A100", "a100-80gb"),
        ("A100 80GB", "a100-80gb"),
        ("a100_40gb", "a100-40gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("h100", "h100-sxm"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("Tesla T4", "t4"),
        ("rtx5090", "rtx-5090"),
        ("A6000", "rtx-a6000"),
        ("2080ti", "rtx-2080-ti"),
        ("RTX2080Ti", "rtx-2080-ti"),
        ("2080 ti", "rtx-2080-ti"),
        ("NVIDIA GeForce RTX 2080 Ti", "rtx-2080-ti"),
        ("rtx 3060 12gb", "rtx-3060"),
        ("4060 Ti 16GB", "rtx-4060-ti-16gb"),
        ("RTX 4080 SUPER", "rtx-4080-super"),
        ("A800 40G", "a800-40gb"),
    ],
)
def test_aliases(text, expected):
    assert get_gpu(text).name == expected


def test_no_two_gpus_share_a_lookup_key():
    # get_gpu builds its index with a conflict check; every entry is reachable by its names
    for gpu in gpu_catalog().values():
        for name in (gpu.name, gpu.display_name, *gpu.aliases):
            assert get_gpu(name) is gpu, name


@pytest.mark.parametrize("text", ["2080", "2080 super", "rtx2080", "2080-ti-11gb"])
def test_suggestions_share_the_numbers_typed(text):
    close = close_gpus(text)
    assert close and close[0] == "rtx-2080-ti"
    assert "b200" not in close


@given(st.sampled_from(sorted(gpu_catalog())), st.sampled_from(["-foo", " zz", "x"]))
def test_suggestions_never_drop_every_number(name, noise):
    numbers = set(re.findall(r"\d+", name))
    for suggested in close_gpus(name + noise):
        gpu = get_gpu(suggested)
        names = " ".join((gpu.name, gpu.display_name, *gpu.aliases))
        assert numbers & set(re.findall(r"\d+", names)) or not numbers


@pytest.mark.parametrize(
    ("text", "total_bytes", "per_node"),
    [("12gb", 12 * 10**9, 1), ("24GiB", 24 * 2**30, 1), ("12 GB", 12 * 10**9, 1),
     ("24gib x4", 24 * 2**30, 4), ("2x80GB", 80 * 10**9, 2), ("11.5gb", 11_500_000_000, 1)],
)
def test_gpu_given_by_size(text, total_bytes, per_node):
    cluster = parse_gpu_arg(text)
    assert cluster.gpu.memory_bytes == total_bytes
    assert cluster.gpus_per_node == per_node
    assert cluster.gpu.bf16 and cluster.gpu.compute_capability == "8.0"
    assert "generic" in cluster.gpu.assumptions[0]
    # the name round-trips (hardware.gpu in a run file holds it)
    assert get_gpu(cluster.gpu.name).memory_bytes == total_bytes


def test_zero_size_is_rejected():
    with pytest.raises(UnknownGPUError, match="above 0"):
        get_gpu("0gb")


@pytest.mark.parametrize(
    ("text", "name", "per_node"),
    [
        ("4090x8", "rtx-4090", 8),
        ("4090 x 8", "rtx-4090", 8),
        ("rtx4090x2", "rtx-4090", 2),
        ("a100-40gb x8", "a100-40gb", 8),
        ("H100 * 4", "h100-sxm", 4),
        ("h100×2", "h100-sxm", 2),
        ("rtx5090", "rtx-5090", 1),
        ("8xA100", "a100-80gb", 8),
        ("2 x rtx-3090", "rtx-3090", 2),
        ("l40s", "l40s", 1),
    ],
)
def test_parse_gpu_counts(text, name, per_node):
    cluster = parse_gpu_arg(text)
    assert cluster.gpu.name == name
    assert cluster.gpus_per_node == per_node
    assert cluster.world_size == per_node


def test_parse_gpu_with_nodes():
    cluster = parse_gpu_arg("a100-40gb x8", nodes=2)
    assert cluster.world_size == 16
    assert cluster.nodes == 2
    assert "x 2 nodes" in cluster.describe()
    assert cluster.to_dict() == {
        "gpu": "a100-40gb", "gpus_per_node": 8, "nodes": 2, "host_ram_bytes": None,
    }


def test_unknown_gpu_lists_close_names():
    with pytest.raises(UnknownGPUError, match=r"unknown GPU 'a100-90gb'.*Closest: .*a100-80gb"):
        get_gpu("a100-90gb")
    with pytest.raises(UnknownGPUError, match=r"oomless gpus"):
        parse_gpu_arg("quantum-9000 x4")


def test_zero_count_is_rejected():
    with pytest.raises(UnknownGPUError, match="at least 1"):
        parse_gpu_arg("4090x0")
    with pytest.raises(UnknownGPUError, match="at least 1"):
        parse_gpu_arg("4090", nodes=0)
