import os

import pytest
import torch  # does not import triton (torch.utils.flop_counter, which `import autosp` loads, does)

os.environ.setdefault("AUTOSP_CHECKS", "1")
# Every test plans afresh (a plan read from disk would not test the planner), whatever the user's shell sets
# (assigned, not defaulted); tests/test_plan_store.py keeps plans in a folder of its own.
os.environ["AUTOSP_PLAN_CACHE"] = "off"
# Without a GPU, the Triton kernels run on CPU tensors in Triton's interpreter, which must be chosen
# before triton is first imported (autosp/kernels/_triton.py); spawned test processes inherit it.
# With a GPU the kernels compile, and tests/gpu runs them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def tma_launches(monkeypatch):
    """Whether each flash-kernel launch of the test took tensor descriptors (flash._tensors' choice)."""
    from autosp.kernels import flash

    seen, choose = [], flash._tensors

    def spy(cfg, blocks):
        tma, tensors = choose(cfg, blocks)
        seen.append(tma)
        return tma, tensors

    monkeypatch.setattr(flash, "_tensors", spy)
    return seen

