"""hostagent/logfiles.py: the host agent's logs (keeper, nginx's, keepalived's, the engine log's writer) are
created 0600 whatever the umask, rotated ones too, and a looser file is tightened and named."""
from __future__ import annotations

import logging
import os
import stat

import pytest

from hostagent import logfiles

pytestmark = pytest.mark.unit


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_rotating_log_under_umask_022_makes_every_file_0600(tmp_path):
    """1. umask 022; the keeper's kind of handler at 200 bytes, 2 backups, in a directory make_dir made.
    2. Enough records for several rotations: the log and both backups are 0600, the directory 0700."""
    loose = os.umask(0o022)
    try:
        logfiles.make_dir(str(tmp_path / "logs"))
        path = tmp_path / "logs" / "keeper.log"
        handler = logfiles.RotatingFileHandler(str(path), maxBytes=200, backupCount=2)
        logger = logging.Logger("test-logfiles")
        logger.addHandler(handler)
        for i in range(40):
            logger.warning("line %d of what the keeper did", i)
        handler.close()
    finally:
        os.umask(loose)
    assert sorted(p.name for p in path.parent.iterdir()) == ["keeper.log", "keeper.log.1", "keeper.log.2"]
    assert {p.name: mode(p) for p in path.parent.iterdir()} == dict.fromkeys(
        ["keeper.log", "keeper.log.1", "keeper.log.2"], 0o600)
    assert mode(tmp_path / "logs") == 0o700


def test_tighten_names_each_loose_file_and_leaves_symlinks_and_private_ones_alone(tmp_path):
    """keeper.log 0644, keeper.log.1 0600, keeper.log.2 a symlink to a 0644 file of someone's: only
    keeper.log changes, and the one sentence names it with its old mode; open_append(say=True) writes that
    sentence into the file it opens."""
    log = tmp_path / "keeper.log"
    log.write_text("old\n")
    log.chmod(0o644)
    (tmp_path / "keeper.log.1").write_text("")
    (tmp_path / "keeper.log.1").chmod(0o600)
    other = tmp_path / "other"
    other.write_text("")
    other.chmod(0o644)
    (tmp_path / "keeper.log.2").symlink_to(other)
    assert logfiles.tighten(str(log), 2) == [f"{log} was mode 0644, readable beyond its user: now 0600"]
    assert mode(log) == 0o600 and mode(other) == 0o644
    out = tmp_path / "keeper.out"
    out.write_text("")
    out.chmod(0o664)
    with logfiles.open_append(str(out), say=True) as f:
        f.write("next\n")
    assert out.read_text() == f"{out} was mode 0664, readable beyond its user: now 0600\nnext\n"
    assert mode(out) == 0o600


def test_a_log_path_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    """1. logs/keeper.log is a symlink to a 0644 file (as to /dev/null or a system file, for an agent run as
    root). 2. Opening the log, by the host agent or the proxy, fails (ELOOP): nothing is appended through
    it and the target keeps its mode. 3. The boot and proxy scripts' private_log refuses it in a sentence."""
    from proxy import logfile as proxy_logfile
    target = tmp_path / "someone-elses"
    target.write_text("theirs\n")
    target.chmod(0o644)
    link = tmp_path / "keeper.log"
    link.symlink_to(target)
    with pytest.raises(OSError):
        logfiles.open_fd(str(link))
    with pytest.raises(OSError):
        proxy_logfile.open_private(str(link))
    assert target.read_text() == "theirs\n" and mode(target) == 0o644
    import subprocess
    from fleet import render
    helper = render.environment().get_template("_private_log.sh.j2").render()
    done = subprocess.run(["bash", "-c", helper + '\nprivate_log "$1"', "x", str(link)], capture_output=True,
                          text=True)
    assert done.returncode == 1 and "is a symlink" in done.stderr and mode(target) == 0o644
