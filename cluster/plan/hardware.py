"""The cluster a plan is for: `local` (this machine), a short spec `2x8xH100`, or a YAML file of nodes.

Devices not at hand are described by their published specs (vendor datasheets: dense bf16 TFLOP/s, HBM
size and bandwidth, the link between the GPUs of a node and between nodes), times an efficiency the user
sets (`--efficiency`, or `efficiency:` in the YAML): every speed derived from one says so in its `source`.

A YAML spec:

    efficiency: {compute: 0.4, memory: 0.7, network: 0.7}   # optional; these are the defaults
    nodes:
      - {count: 2, device: H100, devices: 8, host_memory_gb: 2048}
      - {device: A100-80GB, devices: 4, device_memory_gb: 80, intra_node_gbps: 600, inter_node_gbps: 25}
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

GB = 1e9


class ClusterSpecError(ValueError):
    pass


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator. Bandwidths in GB/s one way; memory in bytes."""

    name: str
    bf16_tflops: float  # dense
    memory_bytes: float
    hbm_gbps: float
    intra_node_gbps: float  # to another device of the same node (NVLink)
    inter_node_gbps: float  # to a device of another node (the NIC each GPU has)
    source: str = "published spec"


# Vendor datasheets (SXM parts; dense bf16, no sparsity). NVLink: one way = half the quoted bidirectional
# figure; inter-node: one 400 Gb/s InfiniBand NIC per GPU (50 GB/s), the common DGX/HGX layout.
PUBLISHED_DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (
    DeviceSpec("H100", 989.0, 80 * GB, 3350.0, 450.0, 50.0, "published spec: NVIDIA H100 SXM datasheet"),
    DeviceSpec("H200", 989.0, 141 * GB, 4800.0, 450.0, 50.0, "published spec: NVIDIA H200 SXM datasheet"),
    DeviceSpec("A100-80GB", 312.0, 80 * GB, 2039.0, 300.0, 25.0, "published spec: NVIDIA A100 SXM datasheet"),
    DeviceSpec("H20", 148.0, 96 * GB, 4000.0, 450.0, 50.0, "published spec: NVIDIA H20 datasheet"),
)}


@dataclass(frozen=True)
class Efficiency:
    """The share of a published peak a run reaches: compute (MFU), memory (HBM reads at decode), network."""

    compute: float = 0.4
    memory: float = 0.7
    network: float = 0.7

    def problems(self) -> list[str]:
        return [f"efficiency.{k} must be in (0, 1], got {v}" for k, v in vars(self).items() if not 0 < v <= 1]


@dataclass(frozen=True)
class NodeSpec:
    device: DeviceSpec
    devices: int
    host_memory_bytes: float = 1024 * GB
    count: int = 1


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    nodes: tuple[NodeSpec, ...]
    efficiency: Efficiency = field(default_factory=Efficiency)
    local: bool = False  # this machine: CPU processes, speeds from its calibration profile

    @property
    def devices_per_node(self) -> int:
        return min(n.devices for n in self.nodes)

    @property
    def total_devices(self) -> int:
        return sum(n.devices * n.count for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return sum(n.count for n in self.nodes)

    @property
    def device(self) -> DeviceSpec:
        """The smallest device (a plan must fit on every node)."""
        return min((n.device for n in self.nodes), key=lambda d: (d.memory_bytes, d.bf16_tflops))

    def describe(self) -> str:
        if self.local:
            return f"local: this machine, {self.nodes[0].devices} CPU cores, {self.device.memory_bytes / GB:.0f} GB RAM"
        return " + ".join(f"{n.count}x{n.devices}x{n.device.name}" for n in self.nodes) + (
            f" (efficiency: compute {self.efficiency.compute}, memory {self.efficiency.memory}, "
            f"network {self.efficiency.network})")


_SHORT = re.compile(r"^(\d+)x(\d+)x([A-Za-z0-9-]+)$")


def parse_cluster(spec: str, efficiency: float | None = None) -> ClusterSpec:
    """`local`, `NODESxDEVICESxNAME` (2x8xH100) or a YAML file. `efficiency` overrides the compute share."""
    if not spec:
        raise ClusterSpecError("--cluster is empty: give local, NODESxDEVICESxNAME (e.g. 2x8xH100) or a YAML of nodes")
    if spec == "local":
        c = local_cluster()
    elif m := _SHORT.match(spec):
        c = ClusterSpec(spec, (NodeSpec(_device(m[3], spec), int(m[2]), count=int(m[1])),))
    elif Path(spec).is_file():
        c = _from_yaml(Path(spec))
    else:
        raise ClusterSpecError(f"--cluster {spec!r} is not local, a short spec NODESxDEVICESxNAME (devices: "
                               f"{', '.join(PUBLISHED_DEVICES)}) or a YAML file that exists")
    if efficiency is not None:
        c = replace(c, efficiency=replace(c.efficiency, compute=efficiency))
    if p := c.efficiency.problems():
        raise ClusterSpecError(f"--cluster {spec}: {'; '.join(p)}")
    if any(n.devices < 1 or n.count < 1 for n in c.nodes):
        raise ClusterSpecError(f"--cluster {spec}: every node needs at least 1 device and a count of at least 1")
    return c


def _device(name: str, where: str) -> DeviceSpec:
    for k, d in PUBLISHED_DEVICES.items():
        if k.lower() == name.lower():
            return d
    raise ClusterSpecError(f"{where}: unknown device {name!r}; known: {', '.join(PUBLISHED_DEVICES)} (or give "
                           "device_memory_gb, bf16_tflops, hbm_gbps in a YAML spec)")


def _from_yaml(path: Path) -> ClusterSpec:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not data["nodes"]:
        raise ClusterSpecError(f"{path}: a cluster YAML needs `nodes:`, a list of {{device, devices, ...}}")
    eff = data.get("efficiency") or {}
    unknown = set(eff) - set(vars(Efficiency()))
    if unknown:
        raise ClusterSpecError(f"{path}: efficiency has unknown keys {sorted(unknown)}; known: compute, memory, network")
    nodes = []
    for i, n in enumerate(data["nodes"]):
        where = f"{path} nodes[{i}]"
        base = _device(n["device"], where) if "device" in n else None
        custom = {k: n[k] for k in ("bf16_tflops", "hbm_gbps", "intra_node_gbps", "inter_node_gbps") if k in n}
        if "device_memory_gb" in n:
            custom["memory_bytes"] = float(n["device_memory_gb"]) * GB
        if base is None:
            need = {"bf16_tflops", "memory_bytes", "hbm_gbps"} - set(custom)
            if need:
                raise ClusterSpecError(f"{where}: no `device:` name, so it needs {sorted(need)} (memory as device_memory_gb)")
            base = DeviceSpec(n.get("name", "custom"), 0, 0, 0, n.get("intra_node_gbps", 50.0), n.get("inter_node_gbps", 12.5),
                              f"given in {path}")
        dev = replace(base, **custom, source=f"{base.source}; overridden in {path}" if custom and "device" in n else base.source)
        nodes.append(NodeSpec(dev, int(n.get("devices", 8)), float(n.get("host_memory_gb", 1024)) * GB, int(n.get("count", 1))))
    return ClusterSpec(path.name, tuple(nodes), Efficiency(**{k: float(v) for k, v in eff.items()}))


def local_cluster() -> ClusterSpec:
    """This machine, as one node whose 'devices' are its CPU cores and whose memory is its RAM."""
    cores = len(os.sched_getaffinity(0))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = DeviceSpec("cpu", 0.0, float(ram), 0.0, 0.0, 0.0, "this machine (speeds from its calibration profile)")
    return ClusterSpec("local", (NodeSpec(cpu, cores, float(ram)),), local=True)
