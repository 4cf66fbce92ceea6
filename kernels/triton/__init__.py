"""Triton implementations of the segmented LoRA kernels (one kernel + launcher per file).

Imported lazily by `kernels` when the backend is "triton". On CPU tensors they run
only under the Triton interpreter: set TRITON_INTERPRET=1 before this is imported.
"""

from kernels.triton.lora_expand import lora_expand_triton
from kernels.triton.lora_shrink import lora_shrink_triton

__all__ = ["lora_expand_triton", "lora_shrink_triton"]
