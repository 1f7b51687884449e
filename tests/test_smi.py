"""The smi parsers, on every published tool output in tests/data/smi (see SOURCES.md there), and on the
sim accelerator's smi run for real."""
from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, ROOT

from fleet.host import smi
from fleet.host.smi import Card, SmiError
from fleet.settings.inventory import BUILTIN_DEFAULTS, HostVars
from fleet.transport.connection import LocalTransport

DATA = Path(__file__).resolve().parent / "data" / "smi"
N = math.nan

# fixture -> (tool given to parse, expected cards as (index, used_mib, total_mib, util_pct, vram_pct))
FIXTURES = {
    "hysmi_default_8x_hcu.txt": ("hy-smi", [(i, N, N, 0.0, 0.0) for i in range(8)]),
    "hysmi_default_2x_hcu_no_decenc.txt": ("dcu", [(0, N, N, 0.0, 0.0), (1, N, N, 0.0, 0.0)]),
    "hysmi_showmeminfo_vram_spaces.txt": ("/opt/hyhal/bin/hy-smi",
                                          [(0, 2, 65520, None, None), (1, N, 65520, None, None),
                                           (7, N, 65520, None, None)]),
    "rocm_smi_json_hygon_k100ai.json": ("/opt/dtk/bin/rocm-smi", [(0, 2, 65520, 0.0, None)]),
    "rocm_smi_json_amd_rx7800xt.json": ("rocm", [(0, 11615703040 / 2**20, 16368.0, 100.0, None)]),
    "nvidia_smi_csv_header.txt": ("nvidia-smi", [(0, 77537, N, 75, None), (1, 5, N, 0, None),
                                                 (2, 74289, N, 100, None), (3, 567, N, 0, None)]),
}
# Not an smi output at all: parsing it must fail, naming the command.
NOT_SMI = {"vllm_metrics_snippet.prom": "hy-smi"}


def as_tuples(cards: list[Card]):
    return [(c.index, c.used_mib, c.total_mib, c.util_pct, c.vram_pct) for c in cards]


def same(got, want) -> bool:
    def eq(a, b):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return a == b if a is None or b is None else math.isclose(a, b)
    return len(got) == len(want) and all(eq(x, y) for g, w in zip(got, want) for x, y in zip(g, w))


@pytest.mark.unit
def test_every_fixture_has_a_case():
    files = {p.name for p in DATA.iterdir() if p.name != "SOURCES.md"}
    assert files == set(FIXTURES) | set(NOT_SMI)


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.unit
def test_each_real_smi_output_parses_to_its_cards(name):
    """A real tool's output (tests/data/smi; SOURCES.md there says where from) parses to the cards it shows."""
    tool, want = FIXTURES[name]
    got = as_tuples(smi.parse(tool, (DATA / name).read_text()))
    assert same(got, want), got


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.unit
def test_fixture_with_tabs_and_other_prefixes(name):
    """The same output with tabs for spaces and DCU/GPU for HCU reads the same."""
    tool, want = FIXTURES[name]
    text = (DATA / name).read_text()
    for variant in (text.replace("          ", "\t\t").replace("     ", "\t"),
                    text.replace("HCU[", "DCU[").replace("HCU ", "DCU "),
                    text.replace("HCU[", "GPU  [ ").replace("HCU ", "GPU\t")):
        assert same(as_tuples(smi.parse(tool, variant)), want), variant


@pytest.mark.parametrize("name", sorted(NOT_SMI))
@pytest.mark.unit
def test_not_an_smi_output(name):
    with pytest.raises(SmiError, match=r"`hy-smi`"):
        smi.parse(NOT_SMI[name], (DATA / name).read_text())


@pytest.mark.parametrize("tool,text,needle", [
    ("hy-smi", "", "printed nothing"),
    ("hy-smi", "HCU[0] : vram Total Used Memory (MiB): lots\n", "cannot read"),
    ("hy-smi", "HCU[0] : vram Total Used Memory: 12\n", "no unit"),
    ("rocm-smi", '{"card0": {"vram Total Memory (MiB)": "655', "cannot read"),
    ("rocm-smi", '{"card0": {"Card Series": "K100_AI"}}', "no memory figures"),
    ("rocm-smi", '{"system": {"Driver version": "6.3"}}', "no card"),
    ("nvidia-smi", "index, memory.used [MiB]\n0, 12 MiB, 3\n", "does not match"),
    ("hy-smi", "HCU     Temp     VRAM%      HCU%\n0       51.0C    0%\n", "fewer columns"),
    ("dcu", "hy-smi: command failed to initialise the driver\n", "cannot read"),
])
@pytest.mark.unit
def test_unreadable_output_is_an_error_naming_the_command(tool, text, needle):
    with pytest.raises(SmiError) as e:
        smi.parse(tool, text)
    assert needle in str(e.value)
    assert f"`{smi.KIND_TOOL.get(tool, tool)}`" in str(e.value)


@pytest.mark.unit
def test_showmeminfo_and_showuse_together_and_rocm_text_in_bytes():
    text = ("============================ System Management Interface ============================\n"
            "HCU[0]\t\t: vram Total Memory (MiB): 65520\n"
            "HCU[0]\t\t: vram Total Used Memory (MiB): 12058\n"
            "HCU[1]\t\t: vram Total Memory (MiB): 65520\n"
            "HCU[1]\t\t: vram Total Used Memory (MiB): 3\n"
            "HCU[0]\t\t: HCU use (%): 87.5\n"
            "HCU[1]\t\t: HCU use (%): N/A\n"
            "=====================================================================================\n")
    assert same(as_tuples(smi.parse("hy-smi", text)),
                [(0, 12058, 65520, 87.5, None), (1, 3, 65520, None, None)])
    amd = ("GPU[0]\t\t: VRAM Total Memory (B): 17163091968\n"
           "GPU[0]\t\t: VRAM Total Used Memory (B): 1048576\n"
           "GPU[0]\t\t: GTT Total Memory (B): 99999999999\n")
    assert same(as_tuples(smi.parse("rocm-smi", amd)), [(0, 1.0, 16368.0, None, None)])


@pytest.mark.unit
def test_nvidia_csv_noheader_nounits_in_query_order():
    text = "0, 40123, 81920, 97\n1, 3, 81920, 0\n2, [N/A], 81920, [N/A]\n"
    assert same(as_tuples(smi.parse("nvidia", text)),
                [(0, 40123, 81920, 97, None), (1, 3, 81920, 0, None), (2, N, 81920, None, None)])
    with_units = "index, memory.used [MiB], memory.total [MiB], utilization.gpu [%]\n0, 10 MiB, 81920 MiB, 5 %\n"
    assert same(as_tuples(smi.parse("nvidia-smi", with_units)), [(0, 10, 81920, 5, None)])


@pytest.mark.process
def test_sim_smi_output_parses_with_a_holder(tmp_path, procs):
    """The sim's smi, run for real, reads through the hy-smi parser: a held card is used, the other idle."""
    from fleet.sim import devices
    dev = tmp_path / "sim-dev"
    devices.ensure_card(dev, list(range(2)))
    holder = procs.start([PYTHON, "-c", "import sys, time; f = open(sys.argv[1]); print('held', flush=True); "
                          "time.sleep(60)", str(dev / "renderD129")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    for extra in ([], ["--showuse"]):
        r = subprocess.run([PYTHON, "-m", "fleet.sim", "smi", "--dev-dir", str(dev), *extra],
                           capture_output=True, text=True, cwd=ROOT, check=True)
        cards = smi.parse("sim", r.stdout)
        assert [c.index for c in cards] == [0, 1]
        assert cards[0].used_mib == devices.IDLE_MIB and cards[0].total_mib == devices.TOTAL_MIB
        assert cards[1].used_mib == devices.IDLE_MIB + devices.ENGINE_MIB
        assert (cards[0].util_pct is not None) == bool(extra)


def _hv(tmp_path, accelerator="dcu", **more) -> HostVars:
    import copy
    v = copy.deepcopy(BUILTIN_DEFAULTS)
    v.update(connection="local", accelerator=accelerator, deploy_dir=str(tmp_path), python=PYTHON,
             engine="sim" if accelerator == "sim" else "vllm", model="m", **more)
    return HostVars.build("h", v, "test")


@pytest.mark.process
def test_read_cards_runs_the_named_smi_with_its_arguments(tmp_path):
    """The inventory's smi names the binary; its arguments follow from its name (hy-smi: vram and use)."""
    fake = tmp_path / "bin" / "hy-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n"
                    "[ \"$*\" = '--showmeminfo vram --showuse' ] || { echo \"bad args: $*\" >&2; exit 2; }\n"
                    f"cat {DATA / 'hysmi_showmeminfo_vram_spaces.txt'}\n")
    fake.chmod(0o755)
    cards = smi.read_cards(LocalTransport("h"), _hv(tmp_path, smi=str(fake)))
    assert [(c.index, c.total_mib) for c in cards] == [(0, 65520), (1, 65520), (7, 65520)]
    broken = tmp_path / "bin" / "nvidia-smi"
    broken.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate' >&2\nexit 9\n")
    broken.chmod(0o755)
    with pytest.raises(smi.RemoteError, match=r"nvidia-smi` failed \(exit 9\): NVIDIA-SMI has failed"):
        smi.read_cards(LocalTransport("h"), _hv(tmp_path, accelerator="nvidia", smi=str(broken)))


@pytest.mark.unit
def test_read_cards_not_found_names_where_it_looked(tmp_path):
    with pytest.raises(smi.SmiNotFound, match=r"/opt/hyhal/bin/hy-smi, /opt/dtk/bin/rocm-smi"):
        env_path = os.environ.get("PATH", "")
        if any(os.path.exists(os.path.join(p, "hy-smi")) for p in env_path.split(":")) or \
                os.path.exists("/opt/hyhal/bin/hy-smi") or os.path.exists("/opt/dtk/bin/rocm-smi"):
            pytest.skip("this machine has a real hy-smi or rocm-smi")
        smi.read_cards(LocalTransport("h"), _hv(tmp_path))


@pytest.mark.process
def test_read_cards_sim(tmp_path, procs):
    from fleet.sim import devices
    devices.ensure_card(tmp_path / "sim-dev", list(range(3)))
    cards = smi.read_cards(LocalTransport("h"), _hv(tmp_path, accelerator="sim", accelerators=3, instances=3))
    assert [(c.index, c.used_mib, c.total_mib) for c in cards] == \
        [(i, devices.IDLE_MIB, devices.TOTAL_MIB) for i in range(3)]
