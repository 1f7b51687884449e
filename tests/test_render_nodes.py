"""DCU and ROCm cards' device files: /dev/mkfd swept with /dev/kfd, and card i's render node found from
sysfs (a fake tree built here), not assumed to be renderD(128+i)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import require_tool, wait_until

from hostagent.probes import holders as hp

from fleet.settings import accelerators


def kfd_node(sysfs: Path, n: int, minor: int, simd: int) -> None:
    d = sysfs / "class" / "kfd" / "kfd" / "topology" / "nodes" / str(n)
    d.mkdir(parents=True)
    (d / "properties").write_text(f"cpu_cores_count {0 if simd else 32}\nsimd_count {simd}\n"
                                  f"drm_render_minor {minor}\nvendor_id 7572\n")


def drm_node(sysfs: Path, minor: int, vendor: str, pci: str) -> None:
    """/sys/class/drm/renderD<minor>/device -> the PCI device's directory, with its vendor."""
    dev = sysfs / "devices" / "pci0000:00" / pci
    dev.mkdir(parents=True, exist_ok=True)
    (dev / "vendor").write_text(vendor + "\n")
    node = sysfs / "class" / "drm" / f"renderD{minor}"
    node.mkdir(parents=True)
    (node / "device").symlink_to(dev)


@pytest.mark.unit
def test_dcu_and_rocm_sweep_mkfd_with_kfd():
    for kind in ("dcu", "rocm"):
        globs = accelerators.device_globs(kind, "/d")
        assert "/dev/kfd" in globs and "/dev/mkfd" in globs
        assert accelerators.kind(kind).render_from_sysfs


@pytest.mark.unit
def test_kfd_topology_order_skips_the_cpu_node_and_a_bmc_render_node(tmp_path):
    """A BMC's graphics device took renderD128: the cards are renderD129 and renderD130, in the KFD
    topology's order (HIP's numbering), here listed out of minor order on purpose."""
    drm_node(tmp_path, 128, "0x1a03", "0000:02:00.0")          # ASPEED BMC graphics
    kfd_node(tmp_path, 0, 0, 0)                                # the CPU
    kfd_node(tmp_path, 1, 130, 120)
    kfd_node(tmp_path, 2, 129, 120)
    assert hp.render_nodes(str(tmp_path)) == ["/dev/dri/renderD130", "/dev/dri/renderD129"]
    assert hp.card_render_files([1], str(tmp_path)) == ["/dev/dri/renderD129"]
    assert hp.card_render_files([7], str(tmp_path)) == []


@pytest.mark.unit
def test_without_kfd_topology_the_kernels_order_of_amd_and_hygon_render_nodes(tmp_path):
    drm_node(tmp_path, 128, "0x1a03", "0000:02:00.0")          # BMC
    drm_node(tmp_path, 131, "0x1d94", "0000:c1:00.0")          # Hygon DCU
    drm_node(tmp_path, 129, "0x1d94", "0000:41:00.0")
    drm_node(tmp_path, 130, "0x1002", "0000:81:00.0")          # AMD
    (tmp_path / "class" / "drm" / "card0").mkdir()
    assert hp.render_nodes(str(tmp_path)) == [f"/dev/dri/renderD{m}" for m in (129, 130, 131)]
    assert hp.card_render_files([0, 2], str(tmp_path)) == ["/dev/dri/renderD129", "/dev/dri/renderD131"]


@pytest.mark.unit
def test_no_sysfs_falls_back_to_128_plus_i(tmp_path):
    assert hp.render_nodes(str(tmp_path)) == []
    assert hp.card_render_files([0, 3], str(tmp_path)) == ["/dev/dri/renderD128", "/dev/dri/renderD131"]


@pytest.mark.process
def test_the_holder_of_card_1s_render_node_is_found_from_sysfs(tmp_path, procs):
    """With a BMC on renderD128, card 1 is renderD130: its holder is found, renderD129's is not."""
    fuser = require_tool("fuser")
    sysfs, dri = tmp_path / "sys", tmp_path / "dri"
    dri.mkdir()
    drm_node(sysfs, 128, "0x1a03", "0000:02:00.0")
    drm_node(sysfs, 129, "0x1d94", "0000:41:00.0")
    drm_node(sysfs, 130, "0x1d94", "0000:81:00.0")
    holders = {}
    for m in (129, 130):
        (dri / f"renderD{m}").touch()
        fd = os.open(dri / f"renderD{m}", os.O_RDONLY)
        try:
            holders[m] = procs.start(["sleep", "60"], pass_fds=(fd,))
        finally:
            os.close(fd)
    spec = {"globs": [], "render_cards": [1], "sysfs": str(sysfs), "dev_dri": str(dri), "spare_tags": []}
    found = wait_until(lambda: hp.holders(spec, fuser)[1] or None, what="fuser to see the holder")
    files, _ = hp.holders(spec, fuser)
    assert files == [str(dri / "renderD130")]
    assert set(found) == {holders[130].pid} and found[holders[130].pid].kind == "yours"
