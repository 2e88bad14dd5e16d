"""Whether autosp's flash kernel beats SDPA for an attention's inputs, by measurement: a lowering choice.

The sharding pass names one attention op (SDPA) and knows no kernels. Lowering (autosp/ir/lower.py,
`attention_kernel`) asks `flash_is_faster` for each attention equation and calls autosp's Triton flash kernel
where the GPU check measured it faster than SDPA at this device, dtype, head dim, mask and length
(kernels.config.measured_speedup), SDPA everywhere else; `autosp explain` asks the same, so it says what runs.
The answer reads only shapes, dtypes and devices: this module knows nothing of the IR above it.
"""
from __future__ import annotations

import torch


def flash_is_faster(q, causal: bool) -> bool:
    """Whether autosp::flash_attention beats SDPA for queries `q` (anything with a tensor's device, ndim, shape
    and dtype: a tensor, a fake, an IR value), by the GPU check's measurement in the kernel config cache
    (kernels.config.measured_speedup); SDPA when unmeasured."""
    device = torch.device(q.device)
    if device.type != "cuda" or q.ndim != 4 or not torch.cuda.is_available():
        return False
    from autosp.kernels import config
    from autosp.kernels._triton import device_name
    speedup = config.measured_speedup(device_name(device), q.dtype, q.shape[-1], causal, q.shape[-2])
    return speedup is not None and speedup > 1.0
