# Correct answers of a student who writes small helpers of their own and plain loops: one query head (and one
# split) at a time, a cache kept as Python dicts of lists, a tree walked node by node, RoPE through the notebook's
# apply_rope_at, float64 wherever the input is float64. The kernel walks its split in a while-style loop over tile
# starts computed once, with the KV head from the group size.

# %% answer="merge_attention_states"
def _combine(state_a, state_b):
    """The merge of two states (out, lse), each part left out when it is empty."""
    out_a, lse_a = state_a
    out_b, lse_b = state_b
    lse = torch.logaddexp(lse_a, lse_b)
    base = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    weight_a, weight_b = torch.exp(lse_a - base), torch.exp(lse_b - base)
    out = torch.where(weight_a[..., None] > 0, weight_a[..., None] * out_a, torch.zeros_like(out_a))
    out = out + torch.where(weight_b[..., None] > 0, weight_b[..., None] * out_b, torch.zeros_like(out_b))
    return out, lse


def merge_attention_states(outs, lses):
    work = torch.float64 if lses.dtype == torch.float64 else torch.float32
    states = [(outs[i].to(work), lses[i].to(work)) for i in range(outs.shape[0])]
    while len(states) > 1:  # a tree of pairwise merges, as ring attention combines GPUs
        paired = [_combine(states[i], states[i + 1]) for i in range(0, len(states) - 1, 2)]
        states = paired + ([states[-1]] if len(states) % 2 else [])
    out, lse = states[0]
    out = torch.where(lse[..., None] == float("-inf"), torch.zeros_like(out), out)  # a lone empty part
    return out.to(outs.dtype), lse.to(lses.dtype)

# %% answer="split_kv_decode"
def _one_split(query, keys, values, scale):
    """(out, lse) of queries [n_rep, d] over keys, values [n, d]; n may be 0."""
    if keys.shape[0] == 0:
        return (torch.zeros(query.shape[0], values.shape[-1], dtype=query.dtype, device=query.device),
                torch.full((query.shape[0],), float("-inf"), dtype=query.dtype, device=query.device))
    scores = query @ keys.T * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[:, None]) @ values, lse


def split_kv_decode(q, k, v, num_splits, scale=None):
    batch, heads, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    if num_splits < 1 or length < 1 or heads % kv_heads:
        raise ValueError(f"need num_splits >= 1 (got {num_splits}), L >= 1 (got {length}) and H_q = {heads} "
                         f"a multiple of H_kv = {kv_heads}")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    group = heads // kv_heads
    size = math.ceil(length / num_splits)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs = torch.zeros(num_splits, batch, heads, dim, dtype=work, device=q.device)
    lses = torch.zeros(num_splits, batch, heads, dtype=work, device=q.device)
    for b in range(batch):
        for g in range(kv_heads):
            for s in range(num_splits):
                piece = slice(s * size, (s + 1) * size)
                out, lse = _one_split(q[b, g * group:(g + 1) * group].to(work), k[b, g, piece].to(work),
                                      v[b, g, piece].to(work), scale)
                outs[s, b, g * group:(g + 1) * group] = out
                lses[s, b, g * group:(g + 1) * group] = lse
    out, lse = merge_attention_states(outs, lses)
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
    group_size = num_heads // num_kv_heads
    my_kv_head = h // group_size
    first_key = split * split_len
    last_key = tl.minimum(first_key + split_len, seq_len) - 1  # inclusive; < first_key when the split is empty
    offs = tl.arange(0, BLOCK)
    running_max = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    running_sum = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    weighted = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tile_start in range(first_key, last_key + 1, BLOCK):
        key_index = tile_start + offs
        in_split = key_index <= last_key
        where = key_index[:, None] * stride_ks + offs_d[None, :]
        both = in_split[:, None] & d_ok[None, :]
        keys = tl.load(K + b * stride_kb + my_kv_head * stride_kh + where, mask=both, other=0.0)
        vals = tl.load(V + b * stride_vb + my_kv_head * stride_vh + where, mask=both, other=0.0)
        logits = tl.sum(keys.to(tl.float32) * q[None, :], axis=1) * sm_scale
        logits = tl.where(in_split, logits, float("-inf"))
        tile_max = tl.max(logits, axis=0)
        new_max = tl.maximum(running_max, tile_max)
        shrink = tl.exp(running_max - new_max)
        weights = tl.exp(logits - new_max)
        running_sum = running_sum * shrink + tl.sum(weights, axis=0)
        weighted = weighted * shrink + tl.sum(weights[:, None] * vals.to(tl.float32), axis=0)
        running_max = new_max
    saw_keys = last_key >= first_key
    divisor = tl.where(saw_keys, running_sum, 1.0)
    out = tl.where(saw_keys, weighted / divisor, 0.0)
    lse = tl.where(saw_keys, running_max + tl.log(divisor), float("-inf"))
    tl.store(OutParts + b * stride_ob + h * stride_oh + split * stride_os + offs_d, out, mask=d_ok)
    tl.store(LseParts + b * stride_lb + h * stride_lh + split, lse)


def triton_split_kv_decode(q, k, v, num_splits, block=16):
    """(out, lse) from your kernel, its parts merged by your merge_attention_states."""
    return launch_split_kv_decode(split_kv_decode_kernel, q, k, v, num_splits, block=block,
                                  merge=merge_attention_states)

# %% answer="slot_mapping"
def _slot_of(table, position, block_size):
    return int(table[position // block_size]) * block_size + position % block_size


def slot_mapping(block_table, start, end, block_size):
    if end < start:
        raise ValueError(f"end = {end} comes before start = {start}")
    if end > len(block_table) * block_size:
        raise ValueError(f"{len(block_table)} blocks of {block_size} cannot hold position {end - 1}")
    slots = torch.empty(end - start, dtype=torch.long)
    for index, position in enumerate(range(start, end)):
        slots[index] = _slot_of(block_table, position, block_size)
    return slots.to(block_table.device) if isinstance(block_table, torch.Tensor) else slots

# %% answer="PagedKVCache"
class PagedKVCache:
    """A pool of blocks with plain Python bookkeeping: dicts of lists, a counter of owners per block."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32,
                 device=None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.k_pool = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v_pool = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.free_list = list(range(num_blocks))
        self.users = {}  # block -> how many sequences use it
        self.tables = {}
        self.lengths = {}
        self.issued = 0

    @property
    def num_free_blocks(self):
        return len(self.free_list)

    def new_sequence(self):
        seq = self.issued
        self.issued += 1
        self.tables[seq] = []
        self.lengths[seq] = 0
        return seq

    def block_table(self, seq):
        return list(self.tables[seq])

    def seq_len(self, seq):
        return self.lengths[seq]

    def _write(self, block, offset, k_token, v_token):
        self.k_pool[block, offset] = k_token.to(self.k_pool.dtype)
        self.v_pool[block, offset] = v_token.to(self.v_pool.dtype)

    def append(self, seq, k, v):
        if seq not in self.tables:
            raise KeyError(seq)
        if k.dim() != 3 or v.dim() != 3 or k.shape != v.shape or k.shape[0] != self.num_kv_heads \
                or k.shape[2] != self.head_dim:
            raise ValueError(f"k and v must both be [{self.num_kv_heads}, n, {self.head_dim}]")
        table, length, count = self.tables[seq], self.lengths[seq], k.shape[1]
        blocks_after = math.ceil((length + count) / self.block_size)
        fresh = blocks_after - len(table)
        partly_filled = length % self.block_size != 0
        shared_tail = count > 0 and partly_filled and self.users[table[-1]] > 1
        wanted = fresh + (1 if shared_tail else 0)
        if wanted > len(self.free_list):
            raise MemoryError(f"append of {count} tokens: {wanted} blocks needed, {len(self.free_list)} free")
        if shared_tail:
            copy = self.free_list.pop()
            self.k_pool[copy] = self.k_pool[table[-1]]
            self.v_pool[copy] = self.v_pool[table[-1]]
            self.users[table[-1]] -= 1
            self.users[copy] = 1
            table[-1] = copy
        for _ in range(fresh):
            block = self.free_list.pop()
            self.users[block] = 1
            table.append(block)
        for token in range(count):
            position = length + token
            self._write(table[position // self.block_size], position % self.block_size, k[:, token], v[:, token])
        self.lengths[seq] = length + count

    def fork(self, seq):
        table, length = list(self.tables[seq]), self.lengths[seq]  # KeyError first, before a new id
        child = self.new_sequence()
        self.tables[child], self.lengths[child] = table, length
        for block in self.tables[child]:
            self.users[block] += 1
        return child

    def free(self, seq):
        table = self.tables.pop(seq)
        self.lengths.pop(seq)
        for block in table:
            self.users[block] -= 1
            if self.users[block] == 0:
                del self.users[block]
                self.free_list.append(block)

# %% answer="paged_decode_attention"
def _gather_sequence(pool, table, length, block_size):
    """The first `length` slots of one sequence, [length, H_kv, d], block by block."""
    pieces = []
    for index in range(math.ceil(length / block_size)):
        block = int(table[index])
        if block < 0:
            raise ValueError(f"a block table ends (-1) before position {index * block_size} of {length} tokens")
        pieces.append(pool[block, :min(block_size, length - index * block_size)])
    return torch.cat(pieces)


def paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens, scale=None):
    batch, heads, dim = q.shape
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    if block_tables.shape[1] * block_size < int(seq_lens.max()):
        raise ValueError(f"block tables of {block_tables.shape[1]} blocks are too short for {int(seq_lens.max())}")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(batch, heads, dim, dtype=work, device=q.device)
    for b in range(batch):
        keys = _gather_sequence(k_pool, block_tables[b], int(seq_lens[b]), block_size).to(work)
        values = _gather_sequence(v_pool, block_tables[b], int(seq_lens[b]), block_size).to(work)
        for h in range(heads):
            g = h // (heads // kv_heads)
            weights = torch.softmax(keys[:, g] @ q[b, h].to(work) * scale, dim=0)
            out[b, h] = weights @ values[:, g]
    return out.to(q.dtype)

# %% answer="sliding_window_mask"
def sliding_window_mask(q_len, kv_len, window):
    if window < 1:
        raise ValueError(f"window = {window}: at least 1")
    rows = []
    for i in range(q_len):
        position = i + kv_len - q_len
        rows.append([position - window < j <= position for j in range(kv_len)])
    return torch.tensor(rows, dtype=torch.bool).reshape(q_len, kv_len)

# %% answer="attention_with_sinks"
def attention_with_sinks(q, k, v, sinks, window=None, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_q, n_k = q.shape[-2], k.shape[-2]
    allowed = sliding_window_mask(n_q, n_k, window if window is not None else n_q + n_k).to(q.device)
    out = torch.zeros(q.shape, dtype=work, device=q.device)
    for h in range(q.shape[1]):  # one head at a time: its own sink
        scores = (q[:, h].to(work) @ k[:, h].to(work).transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        sink = sinks[h].to(work)
        top = torch.maximum(scores.amax(-1), sink)  # [B, S_q]
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        numerators = torch.exp(scores - top[..., None])
        denominator = numerators.sum(-1) + torch.exp(sink - top)
        denominator = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
        out[:, h] = (numerators / denominator[..., None]) @ v[:, h].to(work)
    return out.to(q.dtype)

# %% answer="streaming_kept_positions"
def streaming_kept_positions(seq_len, n_sink, n_recent):
    if seq_len < 0 or n_sink < 0 or n_recent < 0:
        raise ValueError(f"seq_len = {seq_len}, n_sink = {n_sink}, n_recent = {n_recent}: none may be negative")
    kept = []
    for position in range(seq_len):
        if position < n_sink or position >= seq_len - n_recent:
            kept.append(position)
    return torch.tensor(kept, dtype=torch.long)

# %% answer="streaming_decode"
def streaming_decode(q_raw, k_raw, v, n_sink, n_recent, rope_base=10000.0):
    kept = streaming_kept_positions(k_raw.shape[2], n_sink, n_recent)
    cache_positions = torch.arange(len(kept))
    outputs = []
    for slot, original in enumerate(kept.tolist()):  # gather the kept keys one by one, before RoPE
        outputs.append(k_raw[:, :, original:original + 1])
    keys = apply_rope_at(torch.cat(outputs, dim=2), cache_positions, rope_base)
    values = v[:, :, kept.to(v.device)]
    query = apply_rope_at(q_raw[:, :, None], cache_positions[-1:], rope_base)
    weights = torch.softmax(query @ keys.transpose(-1, -2) / math.sqrt(q_raw.shape[-1]), dim=-1)
    return (weights @ values).squeeze(2)

# %% answer="mla_cache_entry"
def _rms_normalise(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def mla_cache_entry(x, w, positions):
    down = x @ w.w_dkv.T
    latent = _rms_normalise(down[..., :w.kv_lora_rank], w.kv_norm_weight, w.norm_eps)
    k_pe = apply_rope_at(down[..., w.kv_lora_rank:], positions, w.rope_base)
    return latent, k_pe

# %% answer="mla_attention_naive"
def _mla_queries(x, w, positions):
    """Each head's q_nope [B, H, T_q, nope] and rotated q_pe [B, H, T_q, rope]."""
    batch, length, _ = x.shape
    q = (x @ w.w_q.T).reshape(batch, length, w.n_heads, -1).permute(0, 2, 1, 3)
    return q[..., :w.qk_nope_dim], apply_rope_at(q[..., w.qk_nope_dim:], positions, w.rope_base)


def _causal_rows(t_q, t_k, device):
    return torch.arange(t_k, device=device)[None, :] <= torch.arange(t_q, device=device)[:, None] + t_k - t_q


def mla_attention_naive(x, w, latent, k_pe, positions):
    q_nope, q_pe = _mla_queries(x, w, positions)
    heads_out = []
    for h in range(w.n_heads):
        rows = w.w_ukv[h * (w.qk_nope_dim + w.v_dim):(h + 1) * (w.qk_nope_dim + w.v_dim)]
        key = torch.cat([latent @ rows[:w.qk_nope_dim].T, k_pe], dim=-1)  # [B, T_k, nope + rope]
        value = latent @ rows[w.qk_nope_dim:].T  # [B, T_k, v]
        query = torch.cat([q_nope[:, h], q_pe[:, h]], dim=-1)  # [B, T_q, nope + rope]
        scores = query @ key.transpose(1, 2) / math.sqrt(w.qk_nope_dim + w.qk_rope_dim)
        scores = scores.masked_fill(~_causal_rows(x.shape[1], latent.shape[1], x.device), float("-inf"))
        heads_out.append(torch.softmax(scores, dim=-1) @ value)
    return torch.cat(heads_out, dim=-1) @ w.w_o.T

# %% answer="mla_attention_absorbed"
def mla_attention_absorbed(x, w, latent, k_pe, positions):
    q_nope, q_pe = _mla_queries(x, w, positions)
    heads_out = []
    for h in range(w.n_heads):
        rows = w.w_ukv[h * (w.qk_nope_dim + w.v_dim):(h + 1) * (w.qk_nope_dim + w.v_dim)]
        w_uk, w_uv = rows[:w.qk_nope_dim], rows[w.qk_nope_dim:]
        query_latent = q_nope[:, h] @ w_uk  # [B, T_q, rank]: W_UK absorbed
        scores = (query_latent @ latent.transpose(1, 2) + q_pe[:, h] @ k_pe.transpose(1, 2))
        scores = scores / math.sqrt(w.qk_nope_dim + w.qk_rope_dim)
        scores = scores.masked_fill(~_causal_rows(x.shape[1], latent.shape[1], x.device), float("-inf"))
        heads_out.append((torch.softmax(scores, dim=-1) @ latent) @ w_uv.T)  # W_UV after the sum
    return torch.cat(heads_out, dim=-1) @ w.w_o.T

# %% answer="mla_cache_bytes"
def mla_cache_bytes(num_layers, kv_lora_rank, qk_rope_dim, seq_len, batch_size, bytes_per_element):
    total = 0.0
    for _ in range(num_layers):  # one layer's latent and RoPE part for every token of every sequence
        total += (kv_lora_rank + qk_rope_dim) * seq_len * batch_size * bytes_per_element
    return math.ceil(total)

# %% answer="tree_attention_mask"
def _ancestors(parents, node):
    chain = []
    while node >= 0:
        chain.append(node)
        node = parents[node]
    return chain


def tree_attention_mask(parents, prefix_len):
    parents = [int(p) for p in parents]
    for child, parent in enumerate(parents):
        if parent >= child or parent < -1:
            raise ValueError(f"parent index {parent} of node {child} must come before it (or be -1)")
    if prefix_len < 0:
        raise ValueError(f"prefix_len = {prefix_len} must be >= 0")
    mask = torch.zeros(len(parents), prefix_len + len(parents), dtype=torch.bool)
    for node in range(len(parents)):
        mask[node, :prefix_len] = True
        for seen in _ancestors(parents, node):
            mask[node, prefix_len + seen] = True
    return mask

# %% answer="tree_position_ids"
def tree_position_ids(parents, prefix_len):
    parents = [int(p) for p in parents]
    return torch.tensor([prefix_len + len(_chain_above(parents, node)) for node in range(len(parents))],
                        dtype=torch.long)


def _chain_above(parents, node):
    above = []
    while parents[node] >= 0:
        node = parents[node]
        above.append(node)
    return above
