"""The host agent's errors: a small tree, each named for its part. Every one is a sentence that says what
to do; `python -m hostagent` reports it as `FLEET_RESULT {"ok": false, "error": ...}`.

Standard library only, Python 3.6+ (bundled with the probes that import lora, fleet.transport.hostcode).
"""


class HostAgentError(Exception):
    """A failure of the host agent, said as one sentence that says what to do."""


class ConfigError(HostAgentError):
    """A config file under conf/ that cannot be read."""


class UsageError(HostAgentError):
    """A command's arguments that do not fit the config (an instance that is not there)."""


class LockHeld(HostAgentError):
    """Another run holds the deployment's run lock."""


class FrontError(HostAgentError):
    """The front: nginx, the proxy, the entry port and their handover."""


class KeeperError(HostAgentError):
    """The keeper: it did not start."""


class LoraError(HostAgentError):
    """Runtime LoRA adapters: a refusal or a failure."""
