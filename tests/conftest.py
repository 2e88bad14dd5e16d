import os

import pytest
import torch

os.environ.setdefault("AUTOSP_CHECKS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
