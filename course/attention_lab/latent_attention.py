"""Notebook 07's weights of a multi-head latent attention layer (DeepSeek's MLA), given to the student.

:class:`MLAWeights` holds the matrices in DeepSeek-V2/V3's layout (PyTorch's ``[out, in]``, as
``nn.Linear`` stores them) and the sizes; :meth:`MLAWeights.random` draws a layer at the scale a
trained one would have. Nothing here computes attention: that is the notebook's exercises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["MLAWeights"]


@dataclass
class MLAWeights:
    """One MLA layer without query compression.

    * ``w_q [H·(qk_nope_dim + qk_rope_dim), D]``: each head's query, its ``qk_nope_dim`` features then its
      ``qk_rope_dim`` features (the part RoPE rotates);
    * ``w_dkv [kv_lora_rank + qk_rope_dim, D]``: the down-projection to what is cached, the latent's
      ``kv_lora_rank`` rows then the ``qk_rope_dim`` rows of the one key part every head shares;
    * ``kv_norm_weight [kv_lora_rank]``: the weight of the RMSNorm of the latent (``norm_eps``);
    * ``w_ukv [H·(qk_nope_dim + v_dim), kv_lora_rank]``: the up-projection; per head its ``qk_nope_dim``
      key rows (``W_UK``), then its ``v_dim`` value rows (``W_UV``), as DeepSeek's ``wkv_b``;
    * ``w_o [D, H·v_dim]``: the output projection.
    """

    w_q: torch.Tensor
    w_dkv: torch.Tensor
    kv_norm_weight: torch.Tensor
    w_ukv: torch.Tensor
    w_o: torch.Tensor
    n_heads: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-6

    @classmethod
    def random(cls, hidden_size: int, n_heads: int, kv_lora_rank: int, qk_nope_dim: int, qk_rope_dim: int,
               v_dim: int, rope_base: float = 10000.0, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None, generator: torch.Generator | None = None) -> "MLAWeights":
        """A layer of random weights, each matrix scaled by ``1/sqrt(fan_in)`` (as ``nn.Linear`` starts) and
        the norm's weight near 1, drawn in float64 on the CPU (every dtype and device sees the same numbers)."""
        if qk_rope_dim % 2:
            raise ValueError(f"qk_rope_dim = {qk_rope_dim} must be even: RoPE rotates pairs of features")

        def matrix(rows: int, columns: int) -> torch.Tensor:
            drawn = torch.randn(rows, columns, generator=generator, dtype=torch.float64) / math.sqrt(columns)
            return drawn.to(dtype=dtype, device=device)

        norm_weight = 1.0 + 0.1 * torch.randn(kv_lora_rank, generator=generator, dtype=torch.float64)
        return cls(w_q=matrix(n_heads * (qk_nope_dim + qk_rope_dim), hidden_size),
                   w_dkv=matrix(kv_lora_rank + qk_rope_dim, hidden_size),
                   kv_norm_weight=norm_weight.to(dtype=dtype, device=device),
                   w_ukv=matrix(n_heads * (qk_nope_dim + v_dim), kv_lora_rank),
                   w_o=matrix(hidden_size, n_heads * v_dim),
                   n_heads=n_heads, kv_lora_rank=kv_lora_rank, qk_nope_dim=qk_nope_dim, qk_rope_dim=qk_rope_dim,
                   v_dim=v_dim, rope_base=rope_base)

    @property
    def hidden_size(self) -> int:
        return self.w_q.shape[1]

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "MLAWeights":
        """A copy with every matrix in ``dtype`` on ``device``."""
        fields = {name: getattr(self, name).to(dtype=dtype, device=device)
                  for name in ("w_q", "w_dkv", "kv_norm_weight", "w_ukv", "w_o")}
        sizes = {name: getattr(self, name) for name in ("n_heads", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim",
                                                        "v_dim", "rope_base", "norm_eps")}
        return MLAWeights(**fields, **sizes)
