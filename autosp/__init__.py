"""autosp: automatic sequence parallelism for long-context training."""
from autosp import ir
from autosp.errors import AutospError
from autosp.trace import trace

__version__ = "0.1.0"
__all__ = ["AutospError", "ir", "trace"]
