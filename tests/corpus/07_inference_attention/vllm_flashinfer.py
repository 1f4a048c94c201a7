# Correct answers written the way serving code writes them: vLLM's slot_mapping loop and its block-walking
# reference attention, FlashInfer's merge of (v, s) states with a "safe" max, a decode kernel that counts its tiles
# with tl.cdiv and keeps finite running maxima (-1e30, as many CUDA kernels do), a cache with reference counts in a
# tensor, SDPA (enable_gqa) wherever a whole attention is meant, DeepSeek's absorbed einsums.

# %% answer="merge_attention_states"
def merge_attention_states(outs, lses):
    # FlashInfer's merge_states: subtract the max state, weight by 2^(s - max) in natural units (exp), normalise.
    work = torch.promote_types(lses.dtype, torch.float32)
    s = lses.to(work)
    s_max = s.amax(dim=0)
    s_max = torch.where(torch.isinf(s_max), torch.zeros_like(s_max), s_max)  # every part empty: a safe 0
    scale = torch.exp(s - s_max)  # [n, ..., S_q]: 0 for an empty part
    total = scale.sum(dim=0)
    v = torch.where(scale[..., None] > 0, outs.to(work), torch.zeros((), dtype=work, device=outs.device))
    merged = (scale[..., None] * v).sum(dim=0) / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    lse = torch.where(total > 0, s_max + torch.log(total), torch.full_like(total, float("-inf")))
    return merged.to(outs.dtype), lse.to(lses.dtype)

# %% answer="split_kv_decode"
def split_kv_decode(q, k, v, num_splits, scale=None):
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    if num_splits < 1 or L < 1:
        raise ValueError(f"split_kv_decode needs num_splits >= 1 and L >= 1, got {num_splits} and {L}")
    if Hq % Hkv:
        raise ValueError(f"GQA needs H_q ({Hq}) divisible by H_kv ({Hkv})")
    part = (L + num_splits - 1) // num_splits
    states_o, states_s = [], []
    q4 = q.unsqueeze(2)  # [B, H_q, 1, d]: one query per sequence
    for first in range(0, part * num_splits, part):
        kk, vv = k[:, :, first:first + part], v[:, :, first:first + part]
        if kk.shape[2] == 0:  # an empty split: its state is (0, -inf)
            states_o.append(torch.zeros(B, Hq, D, dtype=torch.float32, device=q.device))
            states_s.append(torch.full((B, Hq), float("-inf"), device=q.device))
            continue
        o = F.scaled_dot_product_attention(q4.float(), kk.float(), vv.float(), scale=scale, enable_gqa=True)
        scores = torch.einsum("bgrd,bgnd->bgrn", q.float().view(B, Hkv, Hq // Hkv, D), kk.float())
        scores = scores * (scale if scale is not None else D ** -0.5)
        states_o.append(o[:, :, 0])
        states_s.append(torch.logsumexp(scores, dim=-1).reshape(B, Hq))
    out, lse = merge_attention_states(torch.stack(states_o), torch.stack(states_s))
    return out.to(q.dtype), lse

# %% answer="split_kv_decode_kernel"
@triton.jit
def split_kv_decode_kernel(Q, K, V, OutParts, LseParts,
                           stride_qb, stride_qh, stride_kb, stride_kh, stride_ks,
                           stride_vb, stride_vh, stride_vs,
                           stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                           num_heads, num_kv_heads, seq_len, split_len, head_dim, sm_scale,
                           BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """The state (out, lse) of one query head of one sequence over one split of its keys."""
    sequence_head = tl.program_id(0)  # b · H_q + h
    split = tl.program_id(1)
    b = sequence_head // num_heads
    h = sequence_head % num_heads
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    kv_head = h * num_kv_heads // num_heads  # = h // (H_q / H_kv)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    num_tiles = tl.cdiv(tl.maximum(split_end - split_start, 0), BLOCK)
    k_ptrs = K + b * stride_kb + kv_head * stride_kh + offs_d[None, :]
    v_ptrs = V + b * stride_vb + kv_head * stride_vh + offs_d[None, :]
    m = tl.max(tl.full([BLOCK], -1e30, tl.float32), axis=0)  # finite: no -inf - -inf anywhere
    denom = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tile in range(0, num_tiles):
        pos = split_start + tile * BLOCK + tl.arange(0, BLOCK)
        live = pos < split_end
        k = tl.load(k_ptrs + pos[:, None] * stride_ks, mask=live[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_ptrs + pos[:, None] * stride_vs, mask=live[:, None] & d_ok[None, :], other=0.0)
        qk = tl.sum(q[None, :] * k.to(tl.float32), axis=1) * sm_scale
        qk = tl.where(live, qk, -1e30)
        m_new = tl.maximum(m, tl.max(qk, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.where(live, tl.exp(qk - m_new), 0.0)
        denom = denom * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m = m_new
    empty = num_tiles == 0
    safe = tl.where(empty, 1.0, denom)
    out = tl.where(empty, 0.0, acc / safe)
    lse = tl.where(empty, float("-inf"), m + tl.log(safe))
    tl.store(OutParts + b * stride_ob + h * stride_oh + split * stride_os + offs_d, out, mask=d_ok)
    tl.store(LseParts + b * stride_lb + h * stride_lh + split, lse)


def triton_split_kv_decode(q, k, v, num_splits, block=16):
    """(out, lse) from your kernel, its parts merged by your merge_attention_states."""
    return launch_split_kv_decode(split_kv_decode_kernel, q, k, v, num_splits, block=block,
                                  merge=merge_attention_states)

# %% answer="slot_mapping"
def slot_mapping(block_table, start, end, block_size):
    # vLLM's _compute_slot_mapping, one position at a time
    if start > end:
        raise ValueError(f"start {start} > end {end}")
    table = block_table.tolist() if isinstance(block_table, torch.Tensor) else list(block_table)
    if (end - 1) // block_size >= len(table) and end > start:
        raise ValueError(f"position {end - 1} needs block {(end - 1) // block_size}, the table has {len(table)}")
    slots = []
    for i in range(start, end):
        block_number = table[i // block_size]
        block_offset = i % block_size
        slots.append(block_number * block_size + block_offset)
    device = block_table.device if isinstance(block_table, torch.Tensor) else None
    return torch.tensor(slots, dtype=torch.long, device=device)

# %% answer="PagedKVCache"
class PagedKVCache:
    """vLLM's block manager in miniature: reference counts in a tensor, copy-on-write on the first write."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32,
                 device=None):
        self.block_size = block_size
        self.k_pool = torch.zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.v_pool = torch.zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.ref_counts = torch.zeros(num_blocks, dtype=torch.long)
        self.block_tables, self.context_lens = {}, {}
        self.last_id = -1

    @property
    def num_free_blocks(self):
        return int((self.ref_counts == 0).sum())

    def _allocate(self):
        block = int(torch.nonzero(self.ref_counts == 0)[0])  # the lowest free block
        self.ref_counts[block] = 1
        return block

    def new_sequence(self):
        self.last_id += 1
        self.block_tables[self.last_id], self.context_lens[self.last_id] = [], 0
        return self.last_id

    def block_table(self, seq):
        return list(self.block_tables[seq])

    def seq_len(self, seq):
        return self.context_lens[seq]

    def append(self, seq, k, v):
        table = self.block_tables[seq]
        n_heads, head_size = self.k_pool.shape[2], self.k_pool.shape[3]
        if k.shape != v.shape or k.dim() != 3 or (k.shape[0], k.shape[2]) != (n_heads, head_size):
            raise ValueError(f"k, v must be [num_kv_heads={n_heads}, n, head_dim={head_size}]: {tuple(k.shape)}")
        old_len, n = self.context_lens[seq], k.shape[1]
        needed = (old_len + n + self.block_size - 1) // self.block_size - len(table)
        copy_on_write = n > 0 and old_len % self.block_size != 0 and int(self.ref_counts[table[-1]]) > 1
        if needed + copy_on_write > self.num_free_blocks:
            raise MemoryError(f"out of KV blocks: need {needed + copy_on_write}, have {self.num_free_blocks} free")
        if copy_on_write:
            src, dst = table[-1], self._allocate()
            self.k_pool[dst].copy_(self.k_pool[src])
            self.v_pool[dst].copy_(self.v_pool[src])
            self.ref_counts[src] -= 1
            table[-1] = dst
        for _ in range(needed):
            table.append(self._allocate())
        for i in range(n):  # reshape_and_cache: token by token into its slot
            block, offset = divmod(old_len + i, self.block_size)
            self.k_pool[table[block], offset] = k[:, i]
            self.v_pool[table[block], offset] = v[:, i]
        self.context_lens[seq] = old_len + n

    def fork(self, seq):
        child = self.new_sequence()
        self.block_tables[child] = list(self.block_tables[seq])
        self.context_lens[child] = self.context_lens[seq]
        for block in self.block_tables[seq]:
            self.ref_counts[block] += 1
        return child

    def free(self, seq):
        for block in self.block_tables.pop(seq):
            self.ref_counts[block] -= 1
        del self.context_lens[seq]

# %% answer="paged_decode_attention"
def paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens, scale=None):
    # vLLM's ref_single_query_cached_kv_attention: walk the table, copy out each used slot
    num_seqs, num_heads, head_size = q.shape
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    outputs = []
    for i in range(num_seqs):
        context_len = int(seq_lens[i])
        if (block_tables[i] >= 0).sum() * block_size < context_len:
            raise ValueError(f"sequence {i}: block table too short for {context_len} tokens")
        keys, values = [], []
        for j in range(context_len):
            block_number = int(block_tables[i, j // block_size])
            if block_number < 0:
                raise ValueError(f"sequence {i}: position {j} falls on a padding entry")
            keys.append(k_pool[block_number, j % block_size])
            values.append(v_pool[block_number, j % block_size])
        keys = torch.stack(keys, dim=1)  # [H_kv, len, d]
        values = torch.stack(values, dim=1)
        out = F.scaled_dot_product_attention(q[i][:, None], keys, values, scale=scale, enable_gqa=True)
        outputs.append(out[:, 0])
    return torch.stack(outputs)

# %% answer="sliding_window_mask"
def sliding_window_mask(q_len, kv_len, window):
    if window < 1:
        raise ValueError(f"sliding window {window} < 1")
    distance = (torch.arange(q_len)[:, None] + kv_len - q_len) - torch.arange(kv_len)[None, :]
    return (distance >= 0) & (distance < window)

# %% answer="attention_with_sinks"
def attention_with_sinks(q, k, v, sinks, window=None, scale=None):
    # gpt-oss's reference: concatenate the sink as a column, softmax in float32, drop the column
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qk = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    pos = torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q)
    key = torch.arange(n_k, device=q.device)[None, :]
    masked = key > pos
    if window is not None:
        masked |= key <= pos - window
    qk = qk.masked_fill(masked, -torch.inf)
    s = sinks.float().reshape(1, -1, 1, 1).expand(qk.shape[0], -1, n_q, 1)
    qk = torch.cat([qk, s], dim=-1)
    top = qk.max(dim=-1, keepdim=True).values
    top = torch.where(torch.isneginf(top), 0.0, top)
    e = torch.exp(qk - top)
    w = e / e.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.matmul(w[..., :-1], v.float()).to(q.dtype)

# %% answer="streaming_kept_positions"
def streaming_kept_positions(seq_len, n_sink, n_recent):
    if min(seq_len, n_sink, n_recent) < 0:
        raise ValueError("seq_len, n_sink and n_recent must be >= 0")
    if n_sink + n_recent >= seq_len:
        return torch.arange(seq_len, dtype=torch.long)
    return torch.tensor(list(range(n_sink)) + list(range(seq_len - n_recent, seq_len)), dtype=torch.long)

# %% answer="streaming_decode"
def streaming_decode(q_raw, k_raw, v, n_sink, n_recent, rope_base=10000.0):
    # StreamingLLM's pos-shift: keys cached before RoPE, re-rotated at their cache positions every step
    kept = streaming_kept_positions(k_raw.shape[2], n_sink, n_recent).to(k_raw.device)
    cache_len = len(kept)
    keys = apply_rope_at(k_raw.index_select(2, kept), torch.arange(cache_len), rope_base)
    query = apply_rope_at(q_raw.unsqueeze(2), torch.tensor([cache_len - 1]), rope_base)
    return F.scaled_dot_product_attention(query, keys, v.index_select(2, kept)).squeeze(2)

# %% answer="mla_cache_entry"
def mla_cache_entry(x, w, positions):
    kv = torch.matmul(x, w.w_dkv.t())
    c_kv, k_pe = torch.split(kv, [w.kv_lora_rank, w.qk_rope_dim], dim=-1)
    variance = c_kv.pow(2).mean(-1, keepdim=True)
    c_kv = w.kv_norm_weight * (c_kv * torch.rsqrt(variance + w.norm_eps))
    return c_kv, apply_rope_at(k_pe, positions, w.rope_base)

# %% answer="mla_attention_naive"
def mla_attention_naive(x, w, latent, k_pe, positions):
    # DeepSeek's "naive" path: wkv_b up-projects the cache into every head's k_nope and v
    bsz, seqlen, _ = x.shape
    end_pos = latent.shape[1]
    n_heads, nope, rope, v_dim = w.n_heads, w.qk_nope_dim, w.qk_rope_dim, w.v_dim
    q = torch.matmul(x, w.w_q.t()).view(bsz, seqlen, n_heads, nope + rope)
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    q_pe = apply_rope_at(q_pe.transpose(1, 2), positions, w.rope_base).transpose(1, 2)
    kv = torch.matmul(latent, w.w_ukv.t()).view(bsz, end_pos, n_heads, nope + v_dim)
    k_nope, value = torch.split(kv, [nope, v_dim], dim=-1)
    key = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, n_heads, -1)], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1)
    mask = torch.ones(seqlen, end_pos, dtype=torch.bool, device=x.device).tril(end_pos - seqlen)
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=mask, scale=(nope + rope) ** -0.5)
    return torch.matmul(out.transpose(1, 2).reshape(bsz, seqlen, n_heads * v_dim), w.w_o.t())

# %% answer="mla_attention_absorbed"
def mla_attention_absorbed(x, w, latent, k_pe, positions):
    # DeepSeek's "absorb" path: wkv_b's key rows folded into q, its value rows applied after the weighted sum
    bsz, seqlen, _ = x.shape
    end_pos = latent.shape[1]
    n_heads, nope, rope, v_dim = w.n_heads, w.qk_nope_dim, w.qk_rope_dim, w.v_dim
    q = torch.matmul(x, w.w_q.t()).view(bsz, seqlen, n_heads, nope + rope)
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    q_pe = apply_rope_at(q_pe.transpose(1, 2), positions, w.rope_base).transpose(1, 2)
    wkv_b = w.w_ukv.view(n_heads, -1, w.kv_lora_rank)
    q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :nope])
    scores = (torch.einsum("bshc,btc->bsht", q_nope, latent) +
              torch.einsum("bshr,btr->bsht", q_pe, k_pe)) * (nope + rope) ** -0.5
    future = torch.ones(seqlen, end_pos, dtype=torch.bool, device=x.device).triu(end_pos - seqlen + 1)
    scores = scores.masked_fill(future[:, None, :], float("-inf"))
    scores = scores.softmax(dim=-1)
    out = torch.einsum("bsht,btc->bshc", scores, latent)
    out = torch.einsum("bshc,hdc->bshd", out, wkv_b[:, -v_dim:])
    return torch.matmul(out.flatten(2), w.w_o.t())

# %% answer="mla_cache_bytes"
def mla_cache_bytes(num_layers, kv_lora_rank, qk_rope_dim, seq_len, batch_size, bytes_per_element):
    elements = num_layers * seq_len * batch_size * (kv_lora_rank + qk_rope_dim)
    whole, remainder = divmod(elements * round(bytes_per_element * 8), 8)  # in bits, then bytes rounded up
    return whole + (1 if remainder else 0)

# %% answer="tree_attention_mask"
def tree_attention_mask(parents, prefix_len):
    # Medusa's buffers: the tree part of the mask grown from each node's parent row
    parents = [int(p) for p in parents]
    if prefix_len < 0:
        raise ValueError(f"negative prefix_len {prefix_len}")
    size = len(parents)
    tree = torch.eye(size, dtype=torch.bool)
    for i in range(size):
        if not (-1 <= parents[i] < i):
            raise ValueError(f"node {i}: its parent {parents[i]} must be -1 or an earlier node")
        if parents[i] != -1:
            tree[i, :i] = tree[parents[i], :i]
    return torch.cat((torch.ones((size, prefix_len), dtype=torch.bool), tree), dim=1)

# %% answer="tree_position_ids"
def tree_position_ids(parents, prefix_len):
    parents = [int(p) for p in parents]
    ids = torch.full((len(parents),), prefix_len, dtype=torch.long)
    for i, parent in enumerate(parents):
        if parent >= 0:
            ids[i] = ids[parent] + 1
    return ids
