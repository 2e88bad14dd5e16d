"""autosp: automatic sequence parallelism for long-context training."""
from autosp.errors import AutospError

__version__ = "0.1.0"
