"""Triton implementations of the segmented LoRA kernels (one kernel + launcher per file)
and of the fused mixture-of-experts layer (fused_moe.py: its two GEMM kernels;
moe_align.py: the device-side alignment, one operation in two launches; moe_sum.py: the
sum over a token's choices).

Imported lazily by `kernels` when the backend is "triton". On CPU tensors they run
only under the Triton interpreter: set TRITON_INTERPRET=1 before this is imported.
"""

from kernels.triton.fused_moe import fused_moe_triton
from kernels.triton.lora_expand import lora_expand_triton
from kernels.triton.lora_shrink import lora_shrink_triton

__all__ = ["fused_moe_triton", "lora_expand_triton", "lora_shrink_triton"]
