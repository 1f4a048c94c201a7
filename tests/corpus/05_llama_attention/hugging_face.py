# Correct answers in the style of Hugging Face transformers' Llama code: float32 inverse
# frequencies, position_ids-driven cos/sin (LlamaRotaryEmbedding), rotate_half and
# apply_rotary_pos_emb with unsqueeze_dim, GPT-J's rotate_every_two for the adjacent-pair layout,
# LlamaRMSNorm (float32 inside), repeat_kv by expand + reshape, a DynamicCache-like cache grown
# by torch.cat, cache_position, and eager attention with an additive finfo.min mask and the
# softmax in float32.

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
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be divisible by `num_key_value_heads` "
                f"({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"`head_dim` must be even for rotary embeddings, got {self.head_dim}")


# %% answer="causal_mask"
def causal_mask(seq_len, device=None):
    cache_position = torch.arange(seq_len, device=device)
    return torch.arange(seq_len, device=device) <= cache_position.reshape(-1, 1)


# %% answer="rope_frequencies"
def rope_frequencies(head_dim, max_positions, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv_freq)
    return torch.complex(freqs.cos(), freqs.sin())


# %% answer="apply_rope"
def rotate_every_two(x):
    """GPT-J's quarter turn of adjacent pairs: (x[2j], x[2j+1]) -> (-x[2j+1], x[2j])."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope(x, freqs_cis, position_ids, unsqueeze_dim=1):
    input_dtype = x.dtype
    compute_dtype = torch.promote_types(x.dtype, torch.float32)  # half precision up to float32, float64 kept
    rotation = freqs_cis.to(x.device)[position_ids].unsqueeze(unsqueeze_dim)  # [B, 1, S, d/2]
    cos = rotation.real.repeat_interleave(2, dim=-1).to(compute_dtype)  # angle j on features 2j and 2j+1
    sin = rotation.imag.repeat_interleave(2, dim=-1).to(compute_dtype)
    x = x.to(compute_dtype)
    return (x * cos + rotate_every_two(x) * sin).to(input_dtype)


# %% answer="rotate_half"
def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


# %% answer="rope_cos_sin"
def rope_cos_sin(head_dim, position_ids, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=position_ids.device,
                                                                                   dtype=torch.float) / head_dim))
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


# %% answer="apply_rope_rotate_half"
def apply_rope_rotate_half(x, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim).to(x.dtype)
    sin = sin.unsqueeze(unsqueeze_dim).to(x.dtype)
    return (x * cos) + (rotate_half(x) * sin)


# %% answer="interleave_to_half_permutation"
def interleave_to_half_permutation(head_dim):
    # The permutation behind convert_llama_weights_to_hf's view(..., dim // 2, 2, ...).transpose(1, 2).
    return torch.arange(head_dim).view(head_dim // 2, 2).transpose(0, 1).reshape(-1)


# %% answer="qk_norm"
def qk_norm(x, eps):
    # LlamaRMSNorm without its weight.
    input_dtype = x.dtype
    hidden_states = x.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return hidden_states.to(input_dtype)


# %% answer="repeat_kv"
def repeat_kv(x, n_rep):
    """torch.repeat_interleave(x, dim=1, repeats=n_rep), without copying until the reshape."""
    batch, num_key_value_heads, slen, head_dim = x.shape
    if n_rep == 1:
        return x
    hidden_states = x[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


# %% answer="KVCache"
class KVCache:
    def __init__(self):
        self.key_cache = None
        self.value_cache = None

    def get_seq_length(self):
        return 0 if self.key_cache is None else self.key_cache.shape[-2]

    @property
    def seq_len(self):
        return self.get_seq_length()

    def update(self, key_states, value_states):
        if self.key_cache is None:
            self.key_cache, self.value_cache = key_states, value_states
        else:
            self.key_cache = torch.cat([self.key_cache, key_states], dim=-2)
            self.value_cache = torch.cat([self.value_cache, value_states], dim=-2)
        return self.key_cache, self.value_cache


# %% answer="LlamaAttention"
def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def additive_causal_mask(cache_position, target_length, dtype, device):
    """0 where a query at cache_position may attend, finfo.min where it may not."""
    min_dtype = torch.finfo(dtype).min
    blocked = torch.arange(target_length, device=device) > cache_position.reshape(-1, 1)
    return torch.zeros(len(cache_position), target_length, dtype=dtype, device=device).masked_fill(blocked, min_dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.freqs_cis = rope_frequencies(self.head_dim, config.max_position_embeddings, config.rope_theta)

    def forward(self, hidden_states, position_ids=None, kv_cache=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        past_seen_tokens = kv_cache.get_seq_length() if hasattr(kv_cache, "get_seq_length") else (
            kv_cache.seq_len if kv_cache is not None else 0)
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + input_shape[1], device=hidden_states.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0).expand(input_shape[0], -1)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query_states = apply_rope(query_states, self.freqs_cis, position_ids)
        key_states = apply_rope(key_states, self.freqs_cis, position_ids)
        if self.config.use_qk_norm:
            query_states = qk_norm(query_states, self.config.rms_norm_eps)
            key_states = qk_norm(key_states, self.config.rms_norm_eps)
        if kv_cache is not None:
            key_states, value_states = kv_cache.update(key_states, value_states)
        attention_mask = additive_causal_mask(cache_position, key_states.shape[-2], query_states.dtype,
                                              hidden_states.device)
        attn_output, _ = eager_attention_forward(self, query_states, key_states, value_states, attention_mask,
                                                 self.scaling)
        attn_output = self.o_proj(attn_output.reshape(*input_shape, -1).contiguous())
        return attn_output if kv_cache is None else (attn_output, kv_cache)


# %% answer="causal_mask_lower_right"
def causal_mask_lower_right(q_len, kv_len, device=None):
    if q_len > kv_len:
        raise ValueError(f"query length {q_len} is longer than key length {kv_len}")
    cache_position = torch.arange(kv_len - q_len, kv_len, device=device)  # the queries' positions
    return torch.arange(kv_len, device=device) <= cache_position.reshape(-1, 1)


# %% answer="kv_cache_bytes"
def kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
    per_token_per_layer = 2 * num_kv_heads * head_dim * bytes_per_element  # one key and one value vector per KV head
    return num_layers * batch_size * seq_len * per_token_per_layer
