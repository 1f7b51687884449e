"""The host agent's config files (conf/hostagent.json, conf/nginx_front.json), read, and paths under the
deploy_dir they name."""
from __future__ import annotations

import json

from . import layout
from .errors import ConfigError


def load_config(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror}); run `inv deploy` first.") from None
    except ValueError:
        raise ConfigError(f"{path} is not valid JSON; run `inv deploy` to render it again.") from None


def at(cfg: dict, rel: str) -> str:
    """A layout path (hostagent.layout) under the deployment's deploy_dir."""
    return layout.path(cfg["deploy_dir"], rel)
