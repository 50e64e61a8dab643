"""The hardware a plan is for, and its own compiler run without the device (``experiments.plan``).

A ``Hardware`` is one accelerator kind at the size a user rents it: memory, peak bf16 rate and memory
bandwidth per device, how many devices the host or slice has, and how its compiler sees it:

* TPU: the ``libtpu`` wheel (``pip install "jax[tpu]"``) compiles for any TPU topology on a plain CPU
  host. ``topology_devices`` asks it for the devices of a slice (``v5p:2x2x1`` is a v5p-8; ``--topology
  v5p:4x4x4`` a 64-chip pod slice over 16 hosts) and a mesh over them compiles ahead of time exactly as
  on the slice. A process that compiles for a TPU runs with ``JAX_PLATFORMS=tpu``: there is no device
  and no host backend, so any eager device work (an array built outside a program) fails loudly.
* GPU: the CUDA plugin (``pip install "jax[cuda12]"``) compiles for a *target description* without a
  GPU or driver: ``gpu_targets/NAME.txtpb`` (``GpuTargetConfigProto`` text: SM count, shared memory,
  registers, L2, bandwidth, compute capability, cuDNN and CUDA versions; each file states its source).
  Its process runs with ``JAX_PLATFORMS=cpu`` (JAX's cuDNN wrapper asks the default backend for a
  compute capability, which a compile-only GPU has not got) and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``
  (no driver to check).

``compile_env`` is the environment of such a process; ``compiler_installed`` says whether this Python
has the compiler for a platform; ``compiler_info`` what the plan's JSON records about it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

GPU_TARGETS = Path(__file__).resolve().parent / "gpu_targets"
"""The GPU target descriptions, one ``NAME.txtpb`` per GPU hardware name."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator kind: memory per device, devices of the named host / slice, peak rates, and the
    target its own compiler builds for (``platform`` ``tpu`` or ``gpu``; ``target`` a TPU topology name or
    a GPU target description's name)."""

    name: str
    hbm: float
    """Bytes of memory per device (GPU or TPU chip)."""
    devices: int
    """Devices JAX sees on the named host or slice."""
    bf16_flops: float
    """Dense peak FLOP/s of one device for the bfloat16 programs of the presets (a T4 has no bfloat16
    units: XLA computes bfloat16 in float32 there, so its float32 rate)."""
    bandwidth: float
    """Bytes per second of one device's memory (HBM / GDDR)."""
    platform: str
    target: str

    @property
    def topology(self) -> str:
        """What ``topology_devices`` builds: a TPU topology name, or ``1xHxD`` GPUs of a target."""
        if self.platform == "tpu":
            return self.target
        hosts, per_host = (1, self.devices) if self.devices <= 8 else (self.devices // 8, 8)
        return f"1x{hosts}x{per_host}"


@dataclasses.dataclass(frozen=True)
class TpuFamily:
    """Per-chip facts of one TPU generation (Cloud TPU system architecture pages) and how libtpu names
    its topologies: ``megacore`` chips (v4, v5p) show one JAX device per chip of two cores."""

    hbm: float
    bf16_flops: float
    bandwidth: float
    chip_config: str
    chips_per_host: tuple[int, int, int]


TPU_FAMILIES: dict[str, TpuFamily] = {
    # v4: 32 GiB HBM2 at 1,200 GB/s, 275 TFLOP/s bf16 per chip; 4 chips per host.
    "v4": TpuFamily(32 * 2**30, 275e12, 1200e9, "megacore", (2, 2, 1)),
    # v5e: 16 GiB HBM2 at 819 GB/s, 197 TFLOP/s bf16; up to 8 chips per host (v5litepod-8).
    "v5e": TpuFamily(16 * 2**30, 197e12, 819e9, "default", (2, 4, 1)),
    # v5p: 95 GiB HBM2e at 2,765 GB/s, 459 TFLOP/s bf16; 4 chips per host.
    "v5p": TpuFamily(95 * 2**30, 459e12, 2765e9, "megacore", (2, 2, 1)),
    # v6e (Trillium): 32 GiB HBM at 1,640 GB/s, 918 TFLOP/s bf16; up to 8 chips per host.
    "v6e": TpuFamily(32 * 2**30, 918e12, 1640e9, "default", (2, 4, 1)),
}


def _tpu(name: str, topology: str) -> Hardware:
    family = TPU_FAMILIES[topology.split(":")[0]]
    chips = 1
    for size in topology.split(":")[1].split("x"):
        chips *= int(size)
    return Hardware(name, family.hbm, chips, family.bf16_flops, family.bandwidth, "tpu", topology)


# Sources: NVIDIA data sheets (dense rates, no sparsity) and the Cloud TPU system architecture pages.
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    # NVIDIA H100 SXM5: 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s dense BF16; an HGX / DGX host has 8.
    Hardware("h100-80gb", 80e9, 8, 989e12, 3.35e12, "gpu", "h100-80gb"),
    # NVIDIA H200 SXM: 141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s dense BF16; one device (the accelerator
    # check's, docs/performance.md).
    Hardware("h200-141gb", 141e9, 1, 989e12, 4.8e12, "gpu", "h200-141gb"),
    # NVIDIA A100 40 GB SXM4 (Colab's A100): 1,555 GB/s, 312 TFLOP/s dense BF16; one device.
    Hardware("a100-40gb", 40e9, 1, 312e12, 1.555e12, "gpu", "a100-40gb"),
    # NVIDIA L4: 24 GB GDDR6 at 300 GB/s, 121 TFLOP/s dense BF16 (242 with sparsity); one device.
    Hardware("l4-24gb", 24e9, 1, 121e12, 300e9, "gpu", "l4-24gb"),
    # NVIDIA T4: 16 GB GDDR6 at 320 GB/s; 65 TFLOP/s FP16 tensor cores but no bfloat16 units (sm75):
    # bfloat16 runs at the 8.1 TFLOP/s float32 rate. One device (Colab).
    Hardware("t4-16gb", 16e9, 1, 8.1e12, 320e9, "gpu", "t4-16gb"),
    _tpu("tpu-v4", "v4:2x2x1"),  # v4-8: 4 chips
    _tpu("tpu-v5e-1", "v5e:1x1"),  # one v5e chip (Colab's TPU)
    _tpu("tpu-v5e", "v5e:2x4"),  # v5litepod-8: 8 chips
    _tpu("tpu-v5p", "v5p:2x2x1"),  # v5p-8: 4 chips
    _tpu("tpu-v6e-1", "v6e:1x1"),  # one v6e chip
    _tpu("tpu-v6e", "v6e:2x4"),  # v6e-8: 8 chips
)}

DEVICE_KINDS: tuple[tuple[str, str], ...] = (
    ("H100", "h100-80gb"), ("H200", "h200-141gb"), ("A100", "a100-40gb"), ("L4", "l4-24gb"),
    ("T4", "t4-16gb"),
    ("TPU v4", "tpu-v4"), ("TPU v5 lite", "tpu-v5e-1"), ("TPU v5e", "tpu-v5e-1"), ("TPU v5p", "tpu-v5p"),
    ("TPU v5", "tpu-v5p"), ("TPU v6 lite", "tpu-v6e-1"), ("TPU v6e", "tpu-v6e-1"),
)
"""What JAX's ``device_kind`` says (e.g. ``NVIDIA H200``, ``TPU v5 lite``) -> the hardware whose data sheet
gives its peak rates, first match wins (so ``TPU v5 lite`` is a v5e before the bare ``TPU v5`` of a v5p)."""


def hardware_for_device_kind(kind: str) -> Hardware | None:
    """The hardware of a device by its ``device_kind`` (its per-device rates are what the accelerator
    check's predictions use), or None for a device without a data sheet here (a CPU)."""
    for pattern, name in DEVICE_KINDS:
        if re.search(rf"(^|\s){re.escape(pattern)}(\s|$|-)", kind):
            return HARDWARE[name]
    return None


TOPOLOGY_PATTERN = re.compile(r"^(v4|v5e|v5p|v6e):(\d+)x(\d+)(?:x(\d+))?$")


def topology_hardware(topology: str) -> Hardware:
    """The hardware of a TPU topology name (``v5p:4x4x4``: 64 v5p chips); a bad name is a ValueError."""
    match = TOPOLOGY_PATTERN.match(topology)
    if match is None:
        raise ValueError(f"--topology takes FAMILY:AxB[xC] with FAMILY one of {', '.join(TPU_FAMILIES)} "
                         f"(e.g. v5p:4x4x4), got {topology!r}")
    dims = [int(d) for d in match.groups()[1:] if d is not None]
    if min(dims) < 1:
        raise ValueError(f"--topology sizes must be >= 1, got {topology!r}")
    return _tpu(f"tpu-{topology}", topology)


# ----------------------------------------------------------------------------------------------
# the compilers

COMPILER_PACKAGES = {"tpu": ("libtpu", 'pip install "jax[tpu]"'),
                     "gpu": ("jax_cuda12_plugin", 'pip install "jax[cuda12]"')}
"""Per platform: the module whose presence means its compiler is installed, and how to install it."""


def compiler_installed(platform: str) -> bool:
    """Whether this Python has the compiler of ``platform`` (``cpu`` always)."""
    if platform == "cpu":
        return True
    return importlib.util.find_spec(COMPILER_PACKAGES[platform][0]) is not None


def compile_env(platform: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that compiles for ``platform`` without its device (module
    docstring): no host backend for a TPU, the CPU backend and no driver check for a GPU."""
    env = dict(os.environ if environ is None else environ)
    if platform == "tpu":
        env["JAX_PLATFORMS"] = "tpu"
        # libtpu asks for the slice it runs on; compiling for another one, it need not know.
        env.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
        env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        # libtpu locks /tmp/libtpu_lockfile so that two processes do not share a TPU; compiling, there is
        # none to share, and two plans (or a plan and a test) may compile at once.
        env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    elif platform == "gpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def gpu_target_config(name: str) -> str:
    """The text of the target description ``gpu_targets/NAME.txtpb``."""
    return (GPU_TARGETS / f"{name}.txtpb").read_text()


def gpu_compute_capability(name: str) -> tuple[int, int]:
    """(major, minor) of a GPU target description."""
    text = gpu_target_config(name)
    match = re.search(r"cuda_compute_capability\s*{\s*major:\s*(\d+)(?:\s+minor:\s*(\d+))?", text)
    if match is None:
        raise ValueError(f"{name}.txtpb has no cuda_compute_capability")
    return int(match.group(1)), int(match.group(2) or 0)


def topology_devices(hardware: Hardware) -> list[Any]:
    """The devices of ``hardware``'s slice or host, for compiling only (no device needed)."""
    from jax.experimental import topologies

    if hardware.platform == "tpu":
        family = TPU_FAMILIES[hardware.target.split(":")[0]]
        dims = [int(d) for d in hardware.target.split(":")[1].split("x")]
        per_host = tuple(min(h, d) for h, d in zip(family.chips_per_host, [*dims, 1, 1]))
        topology = topologies.get_topology_desc(
            topology_name=hardware.target, platform="tpu", chip_config_name=family.chip_config,
            chips_per_host_bounds=per_host, num_slices=1, wrap=(False, False, False))
    else:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=gpu_target_config(hardware.target), topology=hardware.topology)
    return list(topology.devices)


def compiler_info(hardware: Hardware | None) -> dict[str, str]:
    """``{platform, target, version}`` of the compiler a plan used (None: XLA:CPU on fake devices)."""
    import jax

    if hardware is None:
        return {"platform": "cpu", "target": "fake CPU devices", "version": f"jaxlib {jax.lib.__version__}"}
    package = {"tpu": "libtpu", "gpu": "jax-cuda12-plugin"}[hardware.platform]
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    target = hardware.target
    if hardware.platform == "gpu":
        target = f"{hardware.target}.txtpb x {hardware.devices}"
    return {"platform": hardware.platform, "target": target, "version": f"{package} {version}"}
