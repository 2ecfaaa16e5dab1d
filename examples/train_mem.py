"""The launcher half of the FastChat pair: patch LLaMA attention first, then run examples/train.py's main().

    python examples/train_mem.py --output_dir /tmp/run --use_cpu --max_steps 20 --report_to none
    torchrun --nproc_per_node 2 examples/train_mem.py --output_dir /tmp/run --use_cpu --max_steps 20 --report_to none

Like FastChat's train_mem.py, the patch is applied before `train` (and so before the model) is loaded, on every
rank; the training script's arguments pass through untouched. PATCHKIT_PATCH, PATCHKIT_BACKEND and PATCHKIT_STRICT
choose the patch and backend; PATCHKIT_FLASH_ATTN=0 runs unpatched with the same command line.

The generic equivalent, for any training script, is patchkit's launcher:

    python -m patchkit.launch examples/train.py --output_dir /tmp/run --use_cpu --max_steps 20 --report_to none
    torchrun --nproc_per_node 2 -m patchkit.launch examples/train.py ...
    patchkit run --backend sdpa examples/train.py ...
"""

from __future__ import annotations

import patchkit

if __name__ == "__main__":
    opts = patchkit.PatchArguments.from_env(flash_attn=True)  # patch unless PATCHKIT_FLASH_ATTN=0
    if opts.flash_attn:
        patchkit.apply_patch(opts.patch, backend=opts.attn_backend, strict=opts.patch_strict)

    from train import main  # imported after patching, as FastChat does (sys.path[0] is this directory)

    main()
