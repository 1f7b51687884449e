"""Accelerator kinds: which variable hides the other cards, which device files an engine holds, which smi.

`cpu` is vLLM's CPU backend: no card, no device file, no smi. Instance i gets its own cores
(VLLM_CPU_OMP_THREADS_BIND, worked out on the host by start_cluster.sh) and its KV cache size
(VLLM_CPU_KVCACHE_SPACE); its "memory" is the resident memory of its processes, read from /proc
(hostagent/probes/cpu_mem.py), and it is released when none of them is left.
"""
from __future__ import annotations

from dataclasses import dataclass

from hostagent import layout


@dataclass(frozen=True)
class Kind:
    """What the toolkit needs to know of one accelerator kind."""

    name: str
    visibility_var: str            # set to the instance's card index ("" for cpu: cores are bound instead)
    device_globs: tuple[str, ...]  # files an engine process holds open while it owns a card
    card_files: tuple[str, ...]    # the files of card {i} alone (kfd is shared by every card)
    # Where the smi is looked for, in order. Absolute paths first: PATH over non-interactive SSH
    # lacks /opt/hyhal/bin and /opt/dtk/bin. The arguments follow from the binary's name (fleet.host.smi).
    smi_candidates: tuple[str, ...]
    # True: card i's render node is found on the host from sysfs (hostagent/probes/holders.py), not
    # assumed to be renderD(128+i): a BMC's graphics device or another enumeration shifts them.
    render_from_sysfs: bool = False


_SIM_DEV = "{deploy_dir}/" + layout.SIM_DEV   # the sim accelerator's device files
_HIP_SMI = ("/opt/hyhal/bin/hy-smi", "/opt/dtk/bin/rocm-smi", "/opt/rocm/bin/rocm-smi", "hy-smi", "rocm-smi")

KINDS = {
    # dcu and rocm set HIP_VISIBLE_DEVICES only: setting ROCR_VISIBLE_DEVICES too can hide every card.
    # Hygon hosts also expose /dev/mkfd, which engines hold open beside /dev/kfd.
    "dcu": Kind("dcu", "HIP_VISIBLE_DEVICES", ("/dev/kfd", "/dev/mkfd", "/dev/dri/renderD*", "/dev/dri/card*"),
                (), _HIP_SMI, render_from_sysfs=True),
    "rocm": Kind("rocm", "HIP_VISIBLE_DEVICES", ("/dev/kfd", "/dev/mkfd", "/dev/dri/renderD*", "/dev/dri/card*"),
                 (), ("/opt/rocm/bin/rocm-smi", "/opt/dtk/bin/rocm-smi", "rocm-smi", "/opt/hyhal/bin/hy-smi"),
                 render_from_sysfs=True),
    "nvidia": Kind("nvidia", "CUDA_VISIBLE_DEVICES", ("/dev/nvidia*",), ("/dev/nvidia{index}",),
                   ("/usr/bin/nvidia-smi", "nvidia-smi")),
    # The sim accelerator's device files are plain files under deploy_dir/sim-dev (see fleet.sim);
    # its smi is `python -m fleet.sim smi`, built by fleet.host.smi.smi_command.
    "sim": Kind("sim", "SIM_VISIBLE_DEVICES", (_SIM_DEV + "/kfd", _SIM_DEV + "/renderD*"),
                (_SIM_DEV + "/renderD{render}",), ("fleet.sim",)),
    # vLLM's CPU build: no device files, no smi (memory is read from /proc by hostagent/probes/cpu_mem.py).
    "cpu": Kind("cpu", "", (), (), ()),
}


def kind(name: str) -> Kind:
    """The Kind for an inventory `accelerator` value."""
    return KINDS[name]


def device_globs(name: str, deploy_dir: str) -> list[str]:
    """The device file patterns of a kind on a host whose deploy_dir is given."""
    return [g.format(deploy_dir=deploy_dir) for g in KINDS[name].device_globs]


def card_files(name: str, deploy_dir: str, index: int) -> list[str]:
    """The device files of card `index` alone known without looking at the host (/dev/nvidiaN, the sim's
    renderD(128+index)); a kind with render_from_sysfs has its render node found on the host."""
    return [f.format(deploy_dir=deploy_dir, index=index, render=128 + index) for f in KINDS[name].card_files]
