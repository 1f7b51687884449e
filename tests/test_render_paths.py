"""The templates spell no path under deploy_dir by hand: every one in the rendered files is one that
hostagent/layout.py names (the one spelling; fleet.render hands the templates `layout` and `at`)."""
from __future__ import annotations

import re

import pytest
from conftest import ROOT

from hostagent import layout

from fleet import render
from fleet.settings import inventory

pytestmark = pytest.mark.unit

# Every host of the example inventory: the golden k100-01, a models host (k100-02), the local sim host, a
# cpu host; each also with the API keys' file, which adds nginx's keys include.
HOSTS = ("k100-01", "k100-02", "local", "cpu")
VARIANTS = ((), ("proxy.api_keys_file=keys.txt",))
# Directories layout names whose files are another program's (nginx's temp files, the sim's device files,
# the shipped modules): a path under them is theirs.
OPEN_DIRS = (layout.NGINX_TEMP, layout.SIM_DEV, layout.LIB)
# What stands for an instance index in a script: a number or a shell variable (`$1`, `$i`, `$$`).
INDEX = r"(?:\d+|\$\$|\$\w+)"
_PATH = r"[\w.*<>/-]+(?:(?:\$\$|\$\w+)[\w.*<>/-]*)?"      # a path, with at most one shell variable in it


def named_paths():
    """(the constants, the per-instance patterns) layout names."""
    constants = {value for key, value in vars(layout).items()
                 if key.isupper() and isinstance(value, str) and key not in ("TAG_VAR",)}
    patterns = [re.compile(re.escape(f("XINDEXX")).replace("XINDEXX", INDEX) + "$")
                for f in (layout.instance_pidfile, layout.instance_ready, layout.instance_launch, layout.instance_log,
                          layout.env_setup_out)]
    return constants, patterns


def deploy_dir_paths(text: str, deploy_dir: str) -> set[str]:
    """The paths under deploy_dir a rendered file mentions: after deploy_dir or $DEPLOY_DIR, or relative
    (`run/...`, `./bin/...`, a layout directory's name then a slash)."""
    marked = text.replace(deploy_dir + "/", "\0").replace("$DEPLOY_DIR/", "\0")
    found = set(re.findall("\0(" + _PATH + ")", marked))
    tops = "|".join(re.escape(d) for d in (layout.RUN, layout.LOGS, layout.CONF, layout.BIN, layout.LIB,
                                            layout.SIM_DEV))
    found |= set(re.findall(r"(?:(?<![\w./$-])|(?<=[\s(\"']\./))((?:%s)/%s)" % (tops, _PATH), marked))
    return {p.rstrip(".,;:)/") for p in found}


def is_named(path: str, constants, patterns) -> bool:
    return (path in constants or any(p.match(path) for p in patterns)
            or any(path.startswith(d + "/") for d in OPEN_DIRS))


def rendered_hosts():
    inv = inventory.load(ROOT / "inventory" / "hosts.yml")
    for name in HOSTS:
        for overrides in VARIANTS:
            hv = inv.host_vars(name, list(overrides))
            hv.settings.python = "python3"
            yield name, overrides, hv


def test_every_deploy_dir_path_in_the_rendered_files_is_one_layout_names():
    constants, patterns = named_paths()
    seen, strays = set(), []
    for name, overrides, hv in rendered_hosts():
        for f in render.render_host(hv):
            for path in deploy_dir_paths(f.content, hv.settings.deploy_dir):
                seen.add(path)
                if not is_named(path, constants, patterns):
                    strays.append(f"{name} {' '.join(overrides)}: {f.path}: {path}")
    assert not strays, "paths spelled outside hostagent/layout.py:\n" + "\n".join(sorted(set(strays)))
    # The check reads what it should: the scripts' and configs' own paths are among those found.
    for path in (layout.PROXY_PID, layout.PROXY_LOG, layout.RESULTS_LOG, layout.KEEPER_PID, layout.NGINX_PID,
                 layout.NGINX_UPSTREAM, layout.NGINX_KEYS, layout.PROXY_CONF, layout.NGINX_CONF,
                 layout.instance_log("$1"), layout.instance_pidfile("$1"), layout.env_setup_out("$$")):
        assert path in seen, (path, sorted(seen))


def test_a_path_spelled_by_hand_is_caught():
    """The check itself: a stray `run/...` beside deploy_dir or alone is found and refused."""
    constants, patterns = named_paths()
    text = ('log="$DEPLOY_DIR/logs/proxy.log"\nx=/srv/d/run/other.pid\n'
            '# see run/elsewhere.txt; ./bin/nope.sh\n#!/usr/bin/env')
    found = deploy_dir_paths(text, "/srv/d")
    assert found == {"logs/proxy.log", "run/other.pid", "run/elsewhere.txt", "bin/nope.sh"}
    assert [p for p in sorted(found) if not is_named(p, constants, patterns)] == \
        ["bin/nope.sh", "run/elsewhere.txt", "run/other.pid"]
