"""PyTorch's reference for the course's pre-norm Transformer block (notebooks 03 and 04).

Both notebooks' blocks have the attributes ``norm1``, ``attn`` (``nn.MultiheadAttention``),
``norm2`` and ``mlp`` (``Linear, GELU, Linear``). ``nn.TransformerEncoderLayer`` computes the
same function when configured as a pre-norm block: GELU, LayerNorm eps 1e-6, no dropout.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from attention_lab.checking import freeze_module


def torch_encoder_layer_like(block: nn.Module, embed_dim: int, num_heads: int, hidden: int, *,
                             device: torch.device | str, dtype: torch.dtype,
                             norm_first: bool = True) -> nn.TransformerEncoderLayer:
    """``nn.TransformerEncoderLayer`` holding a copy of ``block``'s weights, on ``device`` in ``dtype``.

    ``norm_first=False`` builds the post-norm layer that a known mistake computes. The block's
    attributes must already have been checked (the copy is strict about names and shapes).
    """
    layer = nn.TransformerEncoderLayer(embed_dim, num_heads, dim_feedforward=hidden, dropout=0.0,
                                       activation="gelu", layer_norm_eps=1e-6, batch_first=True,
                                       norm_first=norm_first, device=device, dtype=dtype)
    pairs = ((layer.self_attn, block.attn), (layer.norm1, block.norm1), (layer.norm2, block.norm2),
             (layer.linear1, block.mlp[0]), (layer.linear2, block.mlp[2]))
    with torch.no_grad():
        for target, source in pairs:
            target.load_state_dict({name: value.detach().to(device, dtype) for name, value in source.state_dict().items()})
    # Training mode (dropout is 0, so it computes the same function) keeps PyTorch off its fused
    # inference fast path: the reference is the plain composition of modules on every device.
    return layer.train()


freeze_module(__name__)
