import os

import pytest
import torch

os.environ.setdefault("AUTOSP_CHECKS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _gpu_ready() -> bool:
    from autosp.kernels import triton_available
    return torch.cuda.is_available() and triton_available()


# The compiled-kernel tests need a GPU; on CPU they are not collected rather than skipped.
collect_ignore = [] if _gpu_ready() else ["gpu"]
