# Correct answers in the style of Meta's llama reference code: a float32 angle table stored as
# complex64 (precompute_freqs_cis), RoPE through view_as_complex, Meta's [B, S, H, d] layout
# inside the module with apply_rotary_emb in float32 and .type_as, Llama 4's L2Norm (float32
# inside), an additive -inf mask widened with hstack for the cache, the softmax in float32, and
# a preallocated KV cache written in place.

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
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"n_heads ({self.num_attention_heads}) must be divisible by n_kv_heads "
                             f"({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")


# %% answer="causal_mask"
def causal_mask(seq_len, device=None):
    additive = torch.triu(torch.full((seq_len, seq_len), float("-inf"), device=device), diagonal=1)
    return additive == 0  # True where Meta's additive mask adds nothing


# %% answer="rope_frequencies"
def rope_frequencies(head_dim, max_positions, base=10000.0):
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2)[: (head_dim // 2)].float() / head_dim))
    t = torch.arange(max_positions, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


# %% answer="apply_rope"
def reshape_for_broadcast(freqs_cis, x):
    """[B, S, d/2] rows of the table -> [B, 1, S, d/2], to broadcast over x's head axis."""
    assert freqs_cis.shape == (x.shape[0], x.shape[2], x.shape[-1])
    return freqs_cis[:, None, :, :]


def apply_rope(x, freqs_cis, position_ids):
    real_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32  # never below float32
    x_ = torch.view_as_complex(x.to(real_dtype).reshape(*x.shape[:-1], -1, 2))
    freqs = reshape_for_broadcast(freqs_cis.to(x.device)[position_ids], x_).to(x_.dtype)
    x_out = torch.view_as_real(x_ * freqs).flatten(3)
    return x_out.type_as(x)


# %% answer="rotate_half"
def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# %% answer="rope_cos_sin"
def rope_cos_sin(head_dim, position_ids, base=10000.0):
    table = rope_frequencies(head_dim, int(position_ids.max()) + 1, base).to(position_ids.device)
    rows = table[position_ids]  # [B, S, d/2]
    return torch.cat((rows.real, rows.real), dim=-1), torch.cat((rows.imag, rows.imag), dim=-1)


# %% answer="apply_rope_rotate_half"
def apply_rope_rotate_half(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c = cos[:, None, :, :half].to(x.dtype)  # angle j, shared by features j and j + half
    s = sin[:, None, :, :half].to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# %% answer="interleave_to_half_permutation"
def interleave_to_half_permutation(head_dim):
    features = torch.arange(head_dim)
    return torch.cat([features[0::2], features[1::2]])


# %% answer="qk_norm"
def qk_norm(x, eps):
    # Llama 4's L2Norm: normalise in float32, cast back.
    def _norm(y):
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)

    return _norm(x.float()).type_as(x)


# %% answer="repeat_kv"
def repeat_kv(x, n_rep):
    # Meta's repeat_kv works on [B, S, H_kv, d]: go there and back (the result is not contiguous).
    bs, n_kv_heads, slen, head_dim = x.shape
    if n_rep == 1:
        return x
    x = x.transpose(1, 2)
    x = x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    return x.transpose(1, 2)


# %% answer="KVCache"
class KVCache:
    """Preallocated, grown by doubling when full; update writes in place and returns views."""

    def __init__(self):
        self.cache_k = None
        self.cache_v = None
        self.length = 0

    @property
    def seq_len(self):
        return self.length

    def update(self, k, v):
        bsz, n_kv_heads, new, head_dim = k.shape
        needed = self.length + new
        if self.cache_k is None or needed > self.cache_k.shape[2]:
            capacity = max(16, 2 * needed)
            grown_k = torch.zeros(bsz, n_kv_heads, capacity, head_dim, dtype=k.dtype, device=k.device)
            grown_v = torch.zeros_like(grown_k)
            if self.cache_k is not None:
                grown_k[:, :, : self.length] = self.cache_k[:, :, : self.length]
                grown_v[:, :, : self.length] = self.cache_v[:, :, : self.length]
            self.cache_k, self.cache_v = grown_k, grown_v
        self.cache_k[:, :, self.length : needed] = k
        self.cache_v[:, :, self.length : needed] = v
        self.length = needed
        return self.cache_k[:, :, :needed], self.cache_v[:, :, :needed]


# %% answer="LlamaAttention"
def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(xq, xk, freqs_cis):
    """Meta's version: xq [B, S, H, d], xk [B, S, H_kv, d], freqs_cis [B, S, d/2]; float32 inside."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, :, None, :]  # [B, S, 1, d/2]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def l2_norm(x, eps):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = config.head_dim
        self.use_qk_norm = config.use_qk_norm
        self.norm_eps = config.rms_norm_eps
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=bias)
        self.freqs_cis = precompute_freqs_cis(self.head_dim, config.max_position_embeddings, config.rope_theta)

    def forward(self, hidden_states, position_ids=None, kv_cache=None):
        bsz, seqlen, _ = hidden_states.shape
        start_pos = 0 if kv_cache is None else kv_cache.seq_len
        if position_ids is None:
            position_ids = torch.arange(start_pos, start_pos + seqlen, device=hidden_states.device)[None].expand(bsz, -1)
        xq = self.q_proj(hidden_states).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.k_proj(hidden_states).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.v_proj(hidden_states).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, self.freqs_cis.to(hidden_states.device)[position_ids])
        if self.use_qk_norm:
            xq, xk = l2_norm(xq, self.norm_eps), l2_norm(xk, self.norm_eps)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)  # [B, heads, S, d]
        if kv_cache is not None:
            xk, xv = kv_cache.update(xk, xv)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        mask = torch.triu(torch.full((seqlen, seqlen), float("-inf"), device=hidden_states.device), diagonal=1)
        mask = torch.hstack([torch.zeros((seqlen, start_pos), device=hidden_states.device), mask]).type_as(xq)
        scores = F.softmax((scores + mask).float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        output = self.o_proj(output)
        return output if kv_cache is None else (output, kv_cache)


# %% answer="causal_mask_lower_right"
def causal_mask_lower_right(q_len, kv_len, device=None):
    if q_len > kv_len:
        raise ValueError(f"{q_len} new tokens but only {kv_len} keys")
    mask = torch.full((q_len, q_len), float("-inf"), device=device).triu(1)
    mask = torch.hstack([torch.zeros((q_len, kv_len - q_len), device=device), mask])
    return mask == 0


# %% answer="kv_cache_bytes"
def kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
    cache_k = batch_size * seq_len * num_kv_heads * head_dim  # Meta's cache_k: [bsz, seq, n_kv, d]
    return num_layers * 2 * cache_k * bytes_per_element
