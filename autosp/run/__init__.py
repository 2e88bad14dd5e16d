"""What the command line runs (autosp/cli.py parses, these do):

    models.py      presets and Hugging Face configs -> transformers causal LMs
    data.py        the default corpus (stdlib source bytes) and token files; batches by (seed, step)
    optim.py       AdamW, warmup + cosine
    train.py       one rank's training loop: autosp.value_and_grad, clip, step, metrics, checkpoints
    checkpoint.py  torch.distributed.checkpoint into tmp-step-N, renamed to step-N when complete
    metrics.py     metrics.jsonl, loss.png, per-rank peak memory
    launch.py      torch.distributed.run in process; which rank failed, and why
    faults.py      AUTOSP_FAULT=RANK:STEP:WHAT, failures on purpose for tests and drills
    plan.py        `autosp plan`: the longest trainable sequence from the memory model
    explain.py     `autosp explain`: the sharded program's summary and a memory timeline PNG
    meshes.py      DeviceMeshes of any size in one process (torch's fake process group), for planning
"""
