"""autosp: automatic sequence parallelism for long-context training."""
from autosp import ir
from autosp.api import compile, explain, plan, shard, value_and_grad  # noqa: A004
from autosp.errors import AutospError
from autosp.params import shard_params
from autosp.sequence_op import sequence_op
from autosp.trace import trace

__version__ = "0.1.0"
__all__ = ["AutospError", "compile", "explain", "ir", "plan", "sequence_op", "shard", "shard_params", "trace", "value_and_grad"]
