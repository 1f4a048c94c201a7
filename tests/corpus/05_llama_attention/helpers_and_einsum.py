# Correct answers written with top-level helpers whose names the notebook's demo cells must not
# rebind (`mask`, `rotate`, `rope`, `softmax`, `attention`, functools' `cache`), einsum and
# einops, 2x2 rotation matrices instead of complex numbers, in-place ops on a clone, GQA by
# grouping the query heads (no repeat at all), a complex RoPE table registered as a buffer, and a
# KV cache that keeps a list of chunks.

# %% answer="LlamaAttentionConfig"
@dataclass
class LlamaAttentionConfig:
    """Hyper-parameters of one Llama attention layer."""

    hidden_size: int = 128
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 8
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    use_qk_norm: bool = True

    def __post_init__(self):
        groups, leftover = divmod(self.num_attention_heads, self.num_key_value_heads)
        if leftover or groups == 0:
            raise ValueError(f"{self.num_attention_heads} query heads cannot be shared evenly by "
                             f"{self.num_key_value_heads} key/value heads")
        if self.head_dim % 2 == 1:
            raise ValueError(f"RoPE rotates pairs of features, so head_dim={self.head_dim} must be even")


# %% answer="causal_mask"
def mask(q_len, kv_len, device=None):
    """True where query i (the last q_len of kv_len tokens) may attend to key j."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


def causal_mask(seq_len, device=None):
    return mask(seq_len, seq_len, device=device)


# %% answer="rope_frequencies"
from functools import cache


@cache  # the same table for the same arguments: built once
def rope_frequencies(head_dim, max_positions, base=10000.0):
    theta = torch.exp(-math.log(base) * torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.einsum("p,j->pj", torch.arange(max_positions, dtype=torch.float64), theta)
    return torch.exp(1j * angles)  # complex128


# %% answer="apply_rope"
from einops import rearrange, repeat


def rotate(pairs, cos, sin):
    """Rotate 2-D points pairs [..., 2] by the angles whose cos and sin are given, with 2x2 matrices."""
    rotation = torch.stack([torch.stack([cos, -sin], dim=-1), torch.stack([sin, cos], dim=-1)], dim=-2)  # [..., 2, 2]
    return torch.einsum("...ij,...j->...i", rotation, pairs)


def rope(x, table_rows):
    """x [B, H, S, d], table_rows [B, S, d/2] complex: each adjacent pair rotated by its row's angle."""
    rows = table_rows.unsqueeze(1)  # [B, 1, S, d/2]
    dtype = torch.promote_types(x.dtype, rows.real.dtype)
    pairs = rearrange(x.to(dtype), "b h s (j two) -> b h s j two", two=2)
    return rearrange(rotate(pairs, rows.real.to(dtype), rows.imag.to(dtype)), "b h s j two -> b h s (j two)")


def apply_rope(x, freqs_cis, position_ids):
    return rope(x, freqs_cis.to(x.device)[position_ids]).to(x.dtype)


# %% answer="rotate_half"
def rotate_half(x):
    half = x.shape[-1] // 2
    out = x.roll(half, dims=-1).clone()  # (x2, x1)
    out[..., :half] *= -1  # (-x2, x1)
    return out


# %% answer="rope_cos_sin"
def rope_cos_sin(head_dim, position_ids, base=10000.0):
    theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device) / head_dim)
    angles = torch.einsum("bs,j->bsj", position_ids.to(torch.float64), theta).repeat(1, 1, 2)  # cat(angles, angles)
    return angles.cos(), angles.sin()


# %% answer="apply_rope_rotate_half"
from einops import rearrange, repeat


def apply_rope_rotate_half(x, cos, sin):
    cos = rearrange(cos, "b s d -> b 1 s d").to(x.dtype)
    sin = rearrange(sin, "b s d -> b 1 s d").to(x.dtype)
    return torch.addcmul(x * cos, rotate_half(x), sin)


# %% answer="interleave_to_half_permutation"
def interleave_to_half_permutation(head_dim):
    return torch.tensor([*range(0, head_dim, 2), *range(1, head_dim, 2)])


# %% answer="qk_norm"
def qk_norm(x, eps):
    return x / x.square().mean(dim=-1, keepdim=True).add(eps).sqrt()


# %% answer="repeat_kv"
from einops import rearrange, repeat


def repeat_kv(x, n_rep):
    return repeat(x, "b h s d -> b (h r) s d", r=n_rep)


# %% answer="KVCache"
class KVCache:
    def __init__(self):
        self.key_chunks, self.value_chunks = [], []

    @property
    def seq_len(self):
        return sum(chunk.shape[2] for chunk in self.key_chunks)

    def update(self, k, v):
        self.key_chunks.append(k)
        self.value_chunks.append(v)
        return torch.cat(self.key_chunks, dim=2), torch.cat(self.value_chunks, dim=2)


# %% answer="LlamaAttention"
from einops import rearrange, repeat


def softmax(scores):
    shifted = scores - scores.amax(dim=-1, keepdim=True)  # every row has an allowed key: the max is finite
    weights = shifted.exp()
    return weights / weights.sum(dim=-1, keepdim=True)


def attention(q, k, v, allowed):
    """Grouped-query attention without repeating K/V: q [B, H_kv, n_rep, S, d], k, v [B, H_kv, T, d]."""
    scores = torch.einsum("bgrsd,bgtd->bgrst", q, k) / math.sqrt(q.shape[-1])
    weights = softmax(scores.masked_fill(~allowed, float("-inf")))
    return torch.einsum("bgrst,bgtd->bgrsd", weights, v)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        hidden, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, hidden, bias=config.attention_bias)
        table = rope_frequencies(d, config.max_position_embeddings, config.rope_theta)
        self.register_buffer("rope_table", table, persistent=False)  # follows .to(device)

    def forward(self, hidden_states, position_ids=None, kv_cache=None):
        c = self.config
        b, s, _ = hidden_states.shape
        past = kv_cache.seq_len if kv_cache is not None else 0
        if position_ids is None:
            position_ids = repeat(torch.arange(past, past + s, device=hidden_states.device), "s -> b s", b=b)
        q = rearrange(self.q_proj(hidden_states), "b s (h d) -> b h s d", d=c.head_dim)
        k = rearrange(self.k_proj(hidden_states), "b s (h d) -> b h s d", d=c.head_dim)
        v = rearrange(self.v_proj(hidden_states), "b s (h d) -> b h s d", d=c.head_dim)
        q, k = apply_rope(q, self.rope_table, position_ids), apply_rope(k, self.rope_table, position_ids)
        if c.use_qk_norm:
            q, k = qk_norm(q, c.rms_norm_eps), qk_norm(k, c.rms_norm_eps)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        grouped_q = rearrange(q, "b (g r) s d -> b g r s d", g=c.num_key_value_heads)  # head h = g·n_rep + r
        out = attention(grouped_q, k, v, mask(s, k.shape[2], device=q.device))
        return_value = self.o_proj(rearrange(out, "b g r s d -> b s (g r d)"))
        return return_value if kv_cache is None else (return_value, kv_cache)


# %% answer="causal_mask_lower_right"
def causal_mask_lower_right(q_len, kv_len, device=None):
    if not 0 < q_len <= kv_len:
        raise ValueError(f"need 0 < q_len <= kv_len, got q_len={q_len}, kv_len={kv_len}")
    return mask(q_len, kv_len, device=device)


# %% answer="kv_cache_bytes"
import numpy as np


def kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
    # np.prod returns a NumPy integer (np.int64): an int all the same
    return np.prod((2, num_layers, num_kv_heads, head_dim, seq_len, batch_size, bytes_per_element), dtype=np.int64)
