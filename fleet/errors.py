"""The error tree: every failure a user can cause or fix is a FleetError with one clear sentence."""


class FleetError(Exception):
    """A failure to report as one sentence that says what to do; never shown as a traceback."""


class InventoryError(FleetError):
    """The inventory file or a --set value is wrong."""


class TemplateError(FleetError):
    """A template could not be rendered (a bug in a template, or a value it cannot use)."""


class RemoteError(FleetError):
    """A command or file operation on a host failed."""


class AgentError(RemoteError):
    """The host agent ran and answered a failure (a swap, a drain, the keeper's start); it says why."""


class UnreachableError(RemoteError):
    """The host could not be reached at all (connection refused, timeout, auth, host key)."""


class InterruptedRun(FleetError):
    """The operator pressed Ctrl-C (or closed the output of a read-only command): the run stops."""
