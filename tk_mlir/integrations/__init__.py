"""tk_mlir's kernels put into models of other libraries.

    from tk_mlir.integrations import patch_llama
    patch_llama(model)      # a transformers Llama (LlamaForCausalLM or LlamaModel)
"""
from __future__ import annotations

from .llama import patch_llama

__all__ = ["patch_llama"]
