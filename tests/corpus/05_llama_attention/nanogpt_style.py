# Correct answers in the style of nanoGPT / minGPT: a lower-triangular `bias` buffer sliced for
# the cache, a -1e9 fill instead of -inf, repeat_interleave for GQA, a cache that starts from
# empty tensors, keyword calls, and a float64-exact RoPE table built from cos and sin.

# %% answer="causal_mask"
def causal_mask(seq_len, device=None):
    return torch.tril(torch.ones(seq_len, seq_len, device=device)).bool()


# %% answer="rope_frequencies"
def rope_frequencies(head_dim, max_positions, base=10000.0):
    exponent = torch.arange(head_dim // 2, dtype=torch.float64) * 2 / head_dim
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] / base**exponent  # p / base^(2j/d)
    return torch.complex(real=torch.cos(angles), imag=torch.sin(angles))


# %% answer="repeat_kv"
def repeat_kv(x, n_rep):
    return torch.repeat_interleave(x, repeats=n_rep, dim=1)


# %% answer="KVCache"
class KVCache:
    def __init__(self):
        self.k = None
        self.v = None

    @property
    def seq_len(self):
        return 0 if self.k is None else self.k.size(2)

    def update(self, k, v):
        if self.k is None:  # start from empty tensors of the right kind
            self.k = k.new_empty(k.size(0), k.size(1), 0, k.size(3))
            self.v = v.new_empty(v.size(0), v.size(1), 0, v.size(3))
        self.k = torch.cat((self.k, k), dim=2)
        self.v = torch.cat((self.v, v), dim=2)
        return self.k, self.v


# %% answer="LlamaAttention"
class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                      config.head_dim)
        self.use_qk_norm, self.eps = config.use_qk_norm, config.rms_norm_eps
        self.q_proj = nn.Linear(config.hidden_size, self.n_head * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_head * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_head * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, config.hidden_size, bias=config.attention_bias)
        n = config.max_position_embeddings
        self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n), persistent=False)
        self.rope = rope_frequencies(self.head_dim, n, config.rope_theta)

    def forward(self, hidden_states, position_ids=None, kv_cache=None):
        B, T, C = hidden_states.size()
        past = 0 if kv_cache is None else kv_cache.seq_len
        if position_ids is None:
            position_ids = (torch.arange(T, device=hidden_states.device) + past).repeat(B, 1)
        q = self.q_proj(hidden_states).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = apply_rope(x=q, freqs_cis=self.rope, position_ids=position_ids)
        k = apply_rope(x=k, freqs_cis=self.rope, position_ids=position_ids)
        if self.use_qk_norm:
            q, k = qk_norm(x=q, eps=self.eps), qk_norm(x=k, eps=self.eps)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        k = repeat_kv(k, n_rep=self.n_head // self.n_kv_head)
        v = repeat_kv(v, n_rep=self.n_head // self.n_kv_head)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, past:past + T, :past + T] == 0, -1e9)
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)
        y = self.o_proj(y)
        return y if kv_cache is None else (y, kv_cache)


# %% answer="causal_mask_lower_right"
def causal_mask_lower_right(q_len, kv_len, device=None):
    if q_len > kv_len:
        raise ValueError(f"cannot align {q_len} queries to the end of {kv_len} keys")
    bias = torch.tril(torch.ones(kv_len, kv_len, device=device))
    return bias[kv_len - q_len:, :] == 1
