"""The fast paths: Triton (and Gluon) kernels, each file naming the PyTorch reference it equals.

This package is the leaf of the project: it imports torch and triton only, never a concept module.
A concept module (nvfp4.py, moe.py, rac.py, rollout.py) chooses, in one visible place, whether to
call a kernel here or its own reference. (Not named `kernels`: that is a Hugging Face package, which
transformers imports when it is installed, and a folder of that name would shadow it.)

What more than one kernel file uses lives in a shared module, and a kernel file imports only those
(and, for a cross-check, another file's entry points):
  - rounding.py: BF16 rounding by integer arithmetic (norm, routing, the NVFP4 quantizer, stores);
  - nvfp4_blocks.py: the NVFP4 format's arithmetic on a tile of blocks (both quantizers);
  - gemm_common.py: the GEMMs' autotuning by bucket of rows, epilogue stores and grouped
    (experts) scheduling (W4A4 Hopper, W4A4 Blackwell, FP8 W8A8);
  - w4a4_common.py: the W4A4 Hopper GEMMs' fp16 operand, their weight decode and main loop;
  - w8a8_common.py: the FP8 GEMMs' x tile, main loop (with its fp32 promotion) and configurations;
  - expert_layout.py: the experts' blocked weight layout (torch only).

INTERPRET: Triton runs the kernels in its CPU interpreter (TRITON_INTERPRET=1, set by the tests
without a GPU). Kernels then take the branches written for it (GPU=False), and the autotuned ones
the small interpreter configurations.
"""

import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
