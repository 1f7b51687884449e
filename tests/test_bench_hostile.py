"""bench/bench_hostile.py's arithmetic: the watcher's worst gap, the polite client's figures, the cases run."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_hostile as bh  # noqa: E402

pytestmark = pytest.mark.unit


def test_the_worst_gap_is_the_longest_time_without_any_answer_edges_included():
    """1. answers every 50 ms, then none until 4.0 s (a stalled loop): the gap is 3.04 s, and a 503 is an
    answer too; 2. answers end at 8 s of a 10 s window: the tail counts; 3. errors are no answers."""
    health = [(t / 20, t / 20 + 0.01, 200) for t in range(20)] + [(1.0, 4.0, 503), (4.0, 4.05, 200)]
    kept = [(t / 20, t / 20 + 0.01, 200) for t in range(100)]     # the kept-alive watcher: answered throughout
    f = bh.health_figures({"start": 0.0, "end": 5.0, "health": health, "kept": kept}, ended=4.5)
    assert f["health_worst_gap_s"] == pytest.approx(4.0 - 0.96)
    assert f["kept_worst_gap_s"] == pytest.approx(0.05) and f["kept_errors"] == 0
    assert (f["health_non_200"], f["health_non_200_after"]) == (1, 0)
    tail = bh.health_figures({"start": 0.0, "end": 10.0, "health": [(0.0, 0.1, 200), (7.9, 8.0, 200)],
                               "kept": []}, ended=9.0)
    assert tail["health_worst_gap_s"] == pytest.approx(7.9)
    none = bh.health_figures({"start": 2.0, "end": 5.0, "health": [(2.0, None, "ClientOSError"), (4.0, None, "")],
                             "kept": [(2.0, None, "ServerDisconnectedError")]},
                             ended=3.0)
    assert none["health_worst_gap_s"] == pytest.approx(3.0)
    assert (none["health_non_200"], none["health_non_200_after"]) == (2, 1)
    assert none["kept_worst_gap_s"] == pytest.approx(3.0) and none["kept_errors"] == 1


def test_polite_figures_count_every_answer_but_200_as_failed_at_the_time_it_failed():
    seen = {"polite": [(0.0, 0.05, 200), (0.5, 0.04, 200), (1.0, 30.0, "timeout"), (1.5, 0.001, 503)]}
    f = bh.polite_figures(seen)
    assert (f["polite_sent"], f["polite_failed"]) == (4, 2)
    assert f["polite_failures"] == {"timeout": 1, "503": 1}
    assert f["polite_worst_s"] == 30.0 and f["polite_p50_s"] == pytest.approx(0.045)


def test_case_c_runs_once_per_connection_count_after_the_polite_client_alone():
    args = bh.parse(["--cases", "a,c,e", "--c-conns", "3000,5000"])
    assert bh.case_names(args) == ["alone", "a", "c3000", "c5000", "e"]
    with pytest.raises(SystemExit, match="unknown case 'z'"):
        bh.case_names(bh.parse(["--cases", "z"]))


def test_quick_shortens_the_holds_unless_one_is_given():
    args = bh.parse(["--quick", "--hold", "12"])
    assert (args.hold, args.alone) == (12.0, bh.QUICK["alone"])
    assert bh.parse([]).hold == bh.NORMAL["hold"]


@pytest.mark.parametrize("client, given, hold", [("", None, 20.0), ("client: {send_timeout_s: 30}", None, 35.0),
                                                 ("client: {send_timeout_s: 5}", None, 20.0),
                                                 ("client: {send_timeout_s: 30}", "12", 12.0)])
def test_case_d_holds_past_the_rendered_send_timeout_unless_told(tmp_path, client, given, hold):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "proxy.yaml").write_text(f"slots: 4\n{client}\n")
    args = bh.parse(["--hold", "20", *(["--hold-d", given] if given else [])])
    assert bh.hold_d(args, type("S", (), {"deploy": tmp_path})()) == hold


@pytest.mark.parametrize("head, status", [(b"HTTP/1.1 413 Payload Too Large\r\n", 413), (b"", "no answer"),
                                          (b"garbage", "no answer")])
def test_an_answer_status_is_read_from_its_first_line(head, status):
    assert bh._status(head) == status
