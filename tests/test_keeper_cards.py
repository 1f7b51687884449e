"""The cards' memory and use in the keeper's /metrics (hostagent/cards.py): the smi outputs it reads (the
real ones of tests/data/smi), the command per accelerator, and a sample at most every 2 s."""
from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest

from hostagent import cards

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parent / "data" / "smi"
MIB = 2 ** 20


@pytest.mark.parametrize("name, expected", [
    ("hysmi_showmeminfo_vram_spaces.txt", {0: {"used": 2 * MIB, "total": 65520 * MIB}, 1: {"total": 65520 * MIB},
                                           7: {"total": 65520 * MIB}}),
    ("rocm_smi_json_hygon_k100ai.json", {0: {"used": 2 * MIB, "total": 65520 * MIB, "use": 0.0}}),
    ("rocm_smi_json_amd_rx7800xt.json", {0: {"used": 11615703040, "total": 17163091968, "use": 1.0}}),
])
def test_the_smi_outputs_the_keeper_reads(name, expected):
    assert cards.parse((DATA / name).read_text()) == expected


def test_nvidia_csv_and_the_sims_report():
    assert cards.parse("0, 77537, 81559, 75\n1, 5, 81559, 0\n") == {
        0: {"used": 77537 * MIB, "total": 81559 * MIB, "use": 0.75}, 1: {"used": 5 * MIB, "total": 81559 * MIB,
                                                                         "use": 0.0}}
    sim = "HCU[0]          : vram Total Memory (MiB): 65520\nHCU[0]          : vram Total Used Memory (MiB): 2050\n" \
          "HCU[0]          : HCU use (%): 50\n"
    assert cards.parse(sim) == {0: {"total": 65520 * MIB, "used": 2050 * MIB, "use": 0.5}}
    assert cards.parse("no smi here") == {}


def test_the_command_per_accelerator(tmp_path):
    """sim: the sim's own smi on the deploy_dir's devices; cpu: none; others: the first candidate found,
    with its arguments; none found: None."""
    argv, env = cards.command({"accelerator": "sim", "deploy_dir": str(tmp_path)})
    assert argv[1:] == ["-m", "fleet.sim", "smi", "--dev-dir", str(tmp_path / "sim-dev"), "--showuse"]
    assert env["PYTHONPATH"].startswith(str(tmp_path / "lib"))
    assert cards.command({"accelerator": "cpu", "deploy_dir": str(tmp_path)}) is None
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    argv, _ = cards.command({"accelerator": "nvidia", "smi_candidates": [str(tmp_path / "none"), str(smi)]})
    assert argv == [str(smi), *cards.SMI_ARGS["nvidia-smi"]]
    assert cards.command({"accelerator": "dcu", "smi_candidates": [str(tmp_path / "none")]}) is None


def test_the_smi_runs_at_most_every_two_seconds_and_a_failure_is_said_once(tmp_path, caplog):
    t = [0.0]
    runs = []

    def run(argv, **kw):
        runs.append(argv)
        ok = len(runs) != 2
        return subprocess.CompletedProcess(argv, 0 if ok else 1, "HCU[0] : HCU use (%): 10\n" if ok else "", "")

    log = logging.getLogger("test.cards")
    s = cards.Sampler({"accelerator": "sim", "deploy_dir": str(tmp_path)}, log, _run=run, _clock=lambda: t[0])
    with caplog.at_level("WARNING", logger="test.cards"):
        assert s.sample() == {0: {"use": 0.1}}
        t[0] = 1.9
        assert s.sample() == {0: {"use": 0.1}} and len(runs) == 1      # within 2 s: the last figures
        t[0] = 2.0
        assert s.sample() == {} and len(runs) == 2                       # the smi failed: no card
        t[0] = 4.0
        assert s.sample() == {0: {"use": 0.1}} and len(runs) == 3
    assert len([r for r in caplog.records if "cards' memory" in r.getMessage()]) == 1


def test_metrics_lines():
    lines = cards.metrics_lines({0: {"used": 2.0, "total": 4.0, "use": 0.5}, 1: {"total": 4.0}}, "d")
    assert lines == [
        "# HELP fleet_card_memory_used_bytes Memory used on the card, from the smi.",
        "# TYPE fleet_card_memory_used_bytes gauge", 'fleet_card_memory_used_bytes{card="0",deployment="d"} 2.0',
        "# HELP fleet_card_memory_total_bytes The card's memory, from the smi.",
        "# TYPE fleet_card_memory_total_bytes gauge", 'fleet_card_memory_total_bytes{card="0",deployment="d"} 4.0',
        'fleet_card_memory_total_bytes{card="1",deployment="d"} 4.0',
        "# HELP fleet_card_utilization The card's utilisation (0-1), from the smi.",
        "# TYPE fleet_card_utilization gauge", 'fleet_card_utilization{card="0",deployment="d"} 0.5']
    assert cards.metrics_lines({}, "d") == []


def test_the_keeper_asks_each_smi_what_the_control_node_asks():
    """hostagent/cards.py spells each smi's arguments itself (the host agent cannot import fleet/): the
    two copies stay one (the nvidia CSV's column order above all)."""
    from fleet.host import smi
    assert cards.SMI_ARGS == smi.SMI_ARGS
