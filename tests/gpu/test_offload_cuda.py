"""Offload on a CUDA/ROCm GPU: pinned host buffers from the pool, reused across steps while the side
stream's copies back are still in flight (run by bench/gpu_check.sh; skipped without a GPU)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA/ROCm GPU: the pinned host pool and its side-stream ordering are not checked here",
                allow_module_level=True)


def test_pinned_buffers_are_reused_across_steps_and_copies_stay_exact():
    from autosp.remat import offload as O
    x = torch.randn(256, 4096, device="cuda")
    ptrs, backs, wants = [], [], []
    for step in range(4):
        y = x * (step + 1)
        h = O.offload(y)                     # written on the side stream
        assert h.is_pinned()
        ptrs.append(h.untyped_storage().data_ptr())
        back = O.prefetch(h, str(y.device))  # read back on the side stream, not waited for yet
        del h                                # the next step's offload may take the buffer at once
        backs.append(back)
        wants.append(y)
    for back, want in zip(backs, wants):
        O.wait(back)
        assert torch.equal(back, want)
    assert len(set(ptrs)) == 1, ptrs


def test_a_value_freed_right_after_its_offload_is_not_overwritten_while_it_is_copied_out():
    """The offload returns before its copy to the host is done (side stream): the value's memory must not be handed
    to the next kernel's output until then (the op records the side stream on it; compiled programs end a segment
    at each offload so that inductor does not reuse the buffer itself: autosp.remat.runtime.offload_cuts)."""
    from autosp.remat import offload as O
    for _ in range(3):
        x = torch.randn(4096, 8192, device="cuda")         # 128 MiB: milliseconds over the host link
        want = x.cpu()
        h = O.offload(x)
        del x
        junk = torch.full((4096, 8192), float("nan"), device="cuda")   # the freed block's next use, at once
        back = O.prefetch(h, "cuda")
        O.wait(back)
        assert torch.equal(back.cpu(), want)
        del junk, back, h
