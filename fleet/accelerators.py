"""Accelerator kinds: which variable hides the other cards, which device files an engine holds."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    """What the toolkit needs to know of one accelerator kind."""

    name: str
    visibility_var: str            # set to the instance's card index
    device_globs: tuple[str, ...]  # files an engine process holds open while it owns a card


KINDS = {
    # dcu and rocm set HIP_VISIBLE_DEVICES only: setting ROCR_VISIBLE_DEVICES too can hide every card.
    "dcu": Kind("dcu", "HIP_VISIBLE_DEVICES", ("/dev/kfd", "/dev/dri/renderD*", "/dev/dri/card*")),
    "rocm": Kind("rocm", "HIP_VISIBLE_DEVICES", ("/dev/kfd", "/dev/dri/renderD*", "/dev/dri/card*")),
    "nvidia": Kind("nvidia", "CUDA_VISIBLE_DEVICES", ("/dev/nvidia*",)),
    # The sim accelerator's device files are plain files under deploy_dir/sim-dev (see fleet.sim).
    "sim": Kind("sim", "SIM_VISIBLE_DEVICES", ("{deploy_dir}/sim-dev/kfd", "{deploy_dir}/sim-dev/renderD*")),
}


def kind(name: str) -> Kind:
    """The Kind for an inventory `accelerator` value."""
    return KINDS[name]


def device_globs(name: str, deploy_dir: str) -> list[str]:
    """The device file patterns of a kind on a host whose deploy_dir is given."""
    return [g.format(deploy_dir=deploy_dir) for g in KINDS[name].device_globs]
