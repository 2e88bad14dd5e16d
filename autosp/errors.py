"""The one exception family of autosp."""


class AutospError(Exception):
    """A user-facing error: names the op, the source line, shapes, layouts, and the fix."""


class TraceError(AutospError):
    """The function could not be traced into the IR."""


class VerifyError(AutospError):
    """A graph broke an IR invariant (SSA, dtypes, shapes)."""


class ShardError(AutospError):
    """The sharding pass could not shard the graph as asked."""
