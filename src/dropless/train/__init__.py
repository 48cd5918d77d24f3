"""``dropless train``: a small Mixtral-style MoE language model trained out of the box.

    presets.py     model and training settings, the named presets
    model.py       the language model (RMSNorm, rotary attention, the dropless MoE)
    data.py        bytes as tokens, the built-in corpus, the held-out split, random batches
    optim.py       AdamW and the warm-up + cosine schedule
    loop.py        the training loop (Trainer)
    checkpoint.py  safetensors checkpoints that resume exactly
    distributed.py torchrun, the process group, DDP
    memory.py      the GPU memory estimate checked before training
    flops.py       model FLOPs utilization
    report.py      loss curve, expert-load heatmap, summary
    generate.py    sampling text from a checkpoint

Nothing here is imported by ``import dropless``; matplotlib, tqdm and safetensors are imported only
when a run needs them.
"""
