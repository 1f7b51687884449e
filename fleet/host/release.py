"""Steps 3 to 5 of a stop: wait until the cards are given back, `--force` the holders, show the cards.

After the process groups and the tag sweep (bin/stop_cluster.sh), a card counts as released when the
accelerator's own smi shows its used memory at or under `release_threshold_mib`. The smi is polled up to
`release_timeout_s` (DCU gives memory back slowly) instead of sleeping a fixed time. With `--force`, the
deploying user's processes still holding the accelerator's device files (fuser) are listed and killed;
another user's process, the stopping process and its ancestors never are. A card not released fails the
stop, naming who holds it.
"""
from __future__ import annotations

import math
import time
from typing import Callable

from hostagent import layout
from hostagent.facts import Holders, parse_holders

from fleet.errors import FleetError
from fleet.host import smi
from fleet.settings import accelerators
from fleet.transport import agent

Emit = Callable[[str], None]


# --- facts --------------------------------------------------------------------------------------

def read_cards(conn, hv) -> tuple[dict[int, smi.Card], str | None]:
    """Card index -> Card, or ({}, why) when the smi cannot be read (no smi, no sim devices yet)."""
    try:
        return {c.index: c for c in smi.read_cards(conn, hv)}, None
    except FleetError as e:
        return {}, str(e)


def device_globs(hv, indexes: list[int] | None) -> list[str]:
    """The device files to look at: every one of the kind, or only those of the given cards."""
    if indexes is None:
        return accelerators.device_globs(hv.settings.accelerator, hv.settings.deploy_dir)
    return [f for i in indexes for f in accelerators.card_files(hv.settings.accelerator, hv.settings.deploy_dir, i)]


def holders(conn, hv, indexes: list[int] | None, instance: int | None = None, kill: bool = False) -> Holders:
    """Who holds the device files (see hostagent/probes/holders.py); with kill, the user's own ones are killed.

    With `instance`, the other instances and the proxy of this deployment are spared.
    """
    spare = []
    if instance is not None:
        spare = [layout.tag(hv.deployment_id, i) for i in range(hv.settings.instances) if i != instance]
        spare += [layout.tag(hv.deployment_id, "proxy")]
    cards = list(hv.cards[instance]) if instance is not None else indexes
    spec = {"globs": device_globs(hv, cards), "spare_tags": spare, "kill": kill, "grace_s": hv.settings.stop_grace_s}
    if cards is not None and accelerators.kind(hv.settings.accelerator).render_from_sysfs:
        spec["render_cards"] = cards
    return parse_holders(agent.run_script(conn, hv, "holders", spec, "listing the device files' holders"))


def release_threshold(hv) -> float:
    """Used memory at or under which a card counts as released. accelerator cpu: 0, for its "card" is
    the resident memory of the instance's processes, 0 only when none of them is left."""
    return 0.0 if hv.settings.accelerator == "cpu" else hv.settings.release_threshold_mib


def released(card: smi.Card | None, threshold_mib: float) -> bool | None:
    """True when the card's used memory is at or under the threshold; None when it is not reported."""
    if card is None or math.isnan(card.used_mib):
        return None
    return card.used_mib <= threshold_mib


# --- the steps ----------------------------------------------------------------------------------

def wait_released(conn, hv, indexes: list[int], emit: Emit, stop_early: Callable[[], bool] | None = None,
                  poll_s: float = 0.5) -> tuple[dict[int, smi.Card], list[int], str | None]:
    """Poll the smi until every card in indexes is released, up to release_timeout_s.

    Returns the last reading, the cards still not released, and why the smi could not be read (if so).
    stop_early, asked when a poll finds cards still used, ends the wait at once when it says True.
    """
    threshold = release_threshold(hv)
    deadline = time.monotonic() + hv.settings.release_timeout_s
    t0 = time.monotonic()
    said = False
    while True:
        cards, why = read_cards(conn, hv)
        if why:
            return cards, [], why
        pending = [i for i in indexes if released(cards.get(i), threshold) is False]
        if not pending:
            if said:
                emit(f"release: {_released_words(hv)} after {time.monotonic() - t0:.1f}s")
            return cards, [], None
        if time.monotonic() >= deadline or (stop_early and stop_early()):
            return cards, pending, None
        if not said:
            emit(f"release: waiting up to {hv.settings.release_timeout_s:g}s for card(s) "
                 f"{', '.join(map(str, pending))} to give their memory back")
            said = True
        time.sleep(min(poll_s, max(0.05, deadline - time.monotonic())))


def card_table(indexes: list[int], before: dict[int, smi.Card], after: dict[int, smi.Card],
               threshold: float, check: bool = False) -> list[str]:
    """One line per card: used/total before and after, and whether it is released."""
    lines = [f"  {'card':<6}{'before':<22}{'after':<22}state"]
    for i in indexes:
        b, a = before.get(i), after.get(i)
        state = released(a, threshold)
        word = ("in use" if released(b, threshold) is False else "free") if check else \
            {True: "released", False: "NOT RELEASED", None: "not reported"}[state]
        lines.append(f"  {i:<6}{b.show() if b else '-':<22}{'-' if check else (a.show() if a else '-'):<22}{word}")
    return lines


def settle(conn, hv, report, emit: Emit, indexes: list[int], before: dict[int, smi.Card],
           before_why: str | None, instance: int | None, check: bool, force: bool) -> None:
    """Steps 3-5 of stop on the cards `indexes`, adding steps to report (hv prepared)."""
    threshold = release_threshold(hv)
    scope = None if instance is None else [instance]
    if check:
        found = holders(conn, hv, scope, instance)
        _check_holders(report, emit, found, force, hv.deployment_id + "/")
        if before:
            emit("cards now:")
            for line in card_table(indexes, before, before, threshold, check=True):
                emit(line)
        return

    def has_holders() -> bool:
        found = holders(conn, hv, scope, instance)
        return bool(found.of_kind("yours"))

    after, pending, why = wait_released(conn, hv, indexes, emit, stop_early=has_holders if force else None)
    if force:
        found = holders(conn, hv, scope, instance, kill=True)
        if found.error:
            report.add("force", "failed", f"{found.error}, then stop again with --force")
        else:
            killed = [h for h in found.holders if h.pid in found.killed]
            for h in killed:
                emit(f"force: killed {h.shown()}, holding {', '.join(h.files)}")
            if found.survivors:
                report.add("force", "failed", "still alive after SIGKILL: " +
                           ", ".join(str(p) for p in found.survivors))
            elif killed:
                report.add("force", "changed", f"killed {len(killed)} process(es) of yours holding the "
                           "device files: " + ", ".join(str(h.pid) for h in killed))
            else:
                report.add("force", "ok", "no process of yours holds the device files")
        if found.killed:
            after, pending, why = wait_released(conn, hv, indexes, emit)

    if why or before_why:
        report.add("release", "skipped", f"cannot read the cards' memory: {why or before_why}")
        return
    emit("instances' memory (resident in their processes/host total, from /proc):" if hv.settings.accelerator == "cpu"
         else "cards (used/total):")
    for line in card_table(indexes, before, after, threshold):
        emit(line)
    unknown = [i for i in indexes if released(after.get(i), threshold) is None]
    if pending:
        found = holders(conn, hv, scope, instance)
        report.add("release", "failed", _not_released_message(hv, pending, after, found, instance))
    else:
        note = f"; card(s) {', '.join(map(str, unknown))} not reported by the smi" if unknown else ""
        report.add("release", "ok", _released_words(hv) + note)


def _released_words(hv) -> str:
    if hv.settings.accelerator == "cpu":
        return "no process of the instances left, their memory given back"
    return f"every card at or under {hv.settings.release_threshold_mib:g} MiB used"


def _check_holders(report, emit: Emit, found: Holders, force: bool, tag_prefix: str) -> None:
    """--check: list who holds the device files and what --force would do with each."""
    if found.error:
        report.add("holders", "skipped", found.error)
        return
    shown = found.of_kind("yours", "spared", "other-user")
    if not shown:
        report.add("holders", "ok", "no process holds the device files")
        return
    for h in shown:
        if h.kind == "yours" and h.tag and h.tag.startswith(tag_prefix):
            what = "stopped with its instance"
        elif h.kind == "yours":
            what = "would be killed" if force else "would be killed with --force"
        elif h.kind == "spared":
            what = "left alone (another instance of this deployment)"
        else:
            what = "never killed (another user's); reported as a holder"
        step = report.add(f"holder {h.pid}", "changed" if what.startswith("would") else "ok",
                          f"{h.shown()} holds {', '.join(h.files)}: {what}")
        emit(f"{step.name}: {step.message}")


def _not_released_message(hv, pending, after, found, instance) -> str:
    if hv.settings.accelerator == "cpu":
        left = ", ".join(f"instance {i} ({after[i].show()} resident)" for i in pending if i in after)
        return (f"processes still alive after {hv.settings.release_timeout_s:g}s: {left}; `inv status --host "
                f"{hv.name}` lists the pids carrying the deployment's tag: stop them by pid")
    cards = ", ".join(f"card {i} ({after[i].show()})" for i in pending if i in after)
    if found.error:
        who = f"; cannot list the holders: {found.error}"
    else:
        hs = found.of_kind("yours", "spared", "other-user")
        who = ("; held by " + "; ".join(h.shown() + (" [another user's]" if h.kind == "other-user"
                                                     else "") for h in hs)) if hs else \
            "; no process visible to you holds its device files (another user's process needs root to " \
            "see; DCU may only be slow: raise release_timeout_s)"
    mine = bool(found.of_kind("yours"))
    target = f" --instance {instance}" if instance is not None else ""
    fix = (f"; `inv stop --host {hv.name}{target} --force` kills the ones that are yours" if mine else
           "; ask the holder's owner to stop it")
    return f"not released after {hv.settings.release_timeout_s:g}s: {cards}{who}{fix}"
