# Correct answers in another style: float32 inside (cast back), einsum everywhere, logaddexp folds instead of a
# stacked logsumexp, a kernel that keeps its running state in base 2 and converts its lse back, an owner-set cache,
# masks from tril/triu, RoPE by cos/sin of the pairs, MLA with F.linear and F.rms_norm.

# %% answer="merge_attention_states"
def merge_attention_states(outs, lses):
    out = torch.zeros(outs.shape[1:], dtype=torch.float32, device=outs.device)
    lse = torch.full(lses.shape[1:], float("-inf"), dtype=torch.float32, device=lses.device)
    for part_out, part_lse in zip(outs.float(), lses.float()):
        total = torch.logaddexp(lse, part_lse)
        finite = torch.isfinite(total)
        keep = torch.exp(torch.where(finite, lse - total, torch.full_like(lse, float("-inf"))))
        take = torch.exp(torch.where(finite, part_lse - total, torch.full_like(lse, float("-inf"))))
        out = keep[..., None] * out + torch.where(take[..., None] > 0, take[..., None] * part_out, 0.0)
        lse = total
    return out.to(outs.dtype), lse.to(lses.dtype)

# %% answer="split_kv_decode"
def split_kv_decode(q, k, v, num_splits, scale=None):
    bsz, n_heads, dim = q.shape
    n_kv, length = k.shape[1], k.shape[2]
    if num_splits < 1:
        raise ValueError(f"num_splits = {num_splits} must be >= 1")
    if length < 1:
        raise ValueError(f"no keys (L = {length})")
    if n_heads % n_kv != 0:
        raise ValueError(f"{n_heads} query heads cannot share {n_kv} KV heads evenly")
    sm_scale = dim ** -0.5 if scale is None else scale
    qf = q.float().view(bsz, n_kv, n_heads // n_kv, dim)
    chunk = -(-length // num_splits)
    outs, lses = [], []
    for s in range(num_splits):
        kk = k[:, :, s * chunk:(s + 1) * chunk].float()
        vv = v[:, :, s * chunk:(s + 1) * chunk].float()
        logits = torch.einsum("bgrd,bgnd->bgrn", qf, kk) * sm_scale
        part_lse = torch.logsumexp(logits, dim=-1)
        probs = torch.exp(logits - part_lse.nan_to_num(neginf=0.0)[..., None])
        outs.append(torch.einsum("bgrn,bgnd->bgrd", probs, vv))
        lses.append(part_lse)
    out, lse = merge_attention_states(torch.stack(outs), torch.stack(lses))
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)

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
    # base 2 inside: scores times log2(e), exp2; the lse converted back to natural log at the end
    q = q * (sm_scale * 1.4426950408889634)
    group = num_heads // num_kv_heads
    kv = h // group
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    m2 = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(lo, hi, BLOCK):
        keys = first + tl.arange(0, BLOCK)
        valid = keys < hi
        k = tl.load(K + b * stride_kb + kv * stride_kh + keys[:, None] * stride_ks + offs_d[None, :],
                    mask=valid[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(V + b * stride_vb + kv * stride_vh + keys[:, None] * stride_vs + offs_d[None, :],
                    mask=valid[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        s2 = tl.where(valid, tl.sum(k * q[None, :], axis=1), float("-inf"))
        new_m = tl.maximum(m2, tl.max(s2, axis=0))
        rescale = tl.exp2(m2 - new_m)
        w = tl.exp2(s2 - new_m)
        total = total * rescale + tl.sum(w, axis=0)
        acc = acc * rescale + tl.sum(w[:, None] * v, axis=0)
        m2 = new_m
    nonempty = total > 0
    denominator = tl.where(nonempty, total, 1.0)
    out = tl.where(nonempty, acc / denominator, 0.0)
    lse = tl.where(nonempty, (m2 + tl.log2(denominator)) * 0.6931471805599453, float("-inf"))
    tl.store(OutParts + b * stride_ob + h * stride_oh + split * stride_os + offs_d, out, mask=d_ok)
    tl.store(LseParts + b * stride_lb + h * stride_lh + split, lse)


def triton_split_kv_decode(q, k, v, num_splits, block=16):
    """(out, lse) from your kernel, its parts merged by your merge_attention_states."""
    return launch_split_kv_decode(split_kv_decode_kernel, q, k, v, num_splits, block=block,
                                  merge=merge_attention_states)

# %% answer="slot_mapping"
def slot_mapping(block_table, start, end, block_size):
    blocks = torch.as_tensor(block_table).long()
    if start > end or end > blocks.numel() * block_size:
        raise ValueError(f"positions [{start}, {end}) do not fit {blocks.numel()} blocks of {block_size}")
    pos = torch.arange(start, end, device=blocks.device)
    return torch.gather(blocks, 0, torch.div(pos, block_size, rounding_mode="floor")) * block_size \
        + torch.remainder(pos, block_size)

# %% answer="PagedKVCache"
class PagedKVCache:
    """Keys and values of many sequences in one pool; each block's owners kept as a set."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32,
                 device=None):
        self.block_size = block_size
        self.k_pool = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                                  device=device)
        self.v_pool = torch.zeros_like(self.k_pool)
        self._free = list(range(num_blocks))
        self._owners = [set() for _ in range(num_blocks)]
        self._tables, self._lens = {}, {}
        self._ids = iter(range(10**9))

    @property
    def num_free_blocks(self):
        return len(self._free)

    def new_sequence(self):
        seq = next(self._ids)
        self._tables[seq], self._lens[seq] = [], 0
        return seq

    def block_table(self, seq):
        return self._tables[seq][:]

    def seq_len(self, seq):
        return self._lens[seq]

    def _take(self, seq):
        block = self._free.pop(0)
        self._owners[block] = {seq}
        return block

    def append(self, seq, k, v):
        table, n_old = self._tables[seq], self._lens[seq]
        _, _, heads, dim = self.k_pool.shape
        if k.dim() != 3 or k.shape[0] != heads or k.shape[2] != dim or v.shape != k.shape:
            raise ValueError(f"append wants k, v of [{heads}, n, {dim}], got {list(k.shape)}, {list(v.shape)}")
        n_new = n_old + k.shape[1]
        grow = -(-n_new // self.block_size) - len(table)
        cow = k.shape[1] > 0 and n_old % self.block_size > 0 and len(self._owners[table[-1]]) > 1
        if grow + int(cow) > len(self._free):
            raise MemoryError(f"{grow + int(cow)} blocks needed, {len(self._free)} free")
        if cow:
            old = table[-1]
            table[-1] = self._take(seq)
            self.k_pool[table[-1]] = self.k_pool[old]
            self.v_pool[table[-1]] = self.v_pool[old]
            self._owners[old].discard(seq)
        table.extend(self._take(seq) for _ in range(grow))
        slots = slot_mapping(table, n_old, n_new, self.block_size).to(self.k_pool.device)
        self.k_pool.flatten(0, 1)[slots] = k.permute(1, 0, 2).to(self.k_pool.dtype)
        self.v_pool.flatten(0, 1)[slots] = v.permute(1, 0, 2).to(self.v_pool.dtype)
        self._lens[seq] = n_new

    def fork(self, seq):
        child = self.new_sequence()
        self._tables[child], self._lens[child] = self._tables[seq][:], self._lens[seq]
        for block in self._tables[seq]:
            self._owners[block].add(child)
        return child

    def free(self, seq):
        table = self._tables.pop(seq)
        del self._lens[seq]
        for block in table:
            self._owners[block].discard(seq)
            if not self._owners[block]:
                self._free.append(block)

# %% answer="paged_decode_attention"
def paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens, scale=None):
    n_seq, n_heads, dim = q.shape
    page, n_kv = k_pool.shape[1], k_pool.shape[2]
    sm_scale = dim ** -0.5 if scale is None else scale
    keys_flat, values_flat = k_pool.flatten(0, 1), v_pool.flatten(0, 1)
    result = []
    for i in range(n_seq):
        n = int(seq_lens[i])
        pages = block_tables[i][: (n + page - 1) // page]
        if len(pages) * page < n or (pages < 0).any():
            raise ValueError(f"sequence {i}: {n} tokens but block table {block_tables[i].tolist()}")
        slots = slot_mapping(pages, 0, n, page).to(q.device)
        kk, vv = keys_flat[slots].float(), values_flat[slots].float()  # [n, H_kv, d]
        qq = q[i].float().view(n_kv, n_heads // n_kv, dim)
        p = torch.softmax(torch.einsum("grd,ngd->grn", qq, kk) * sm_scale, dim=-1)
        result.append(torch.einsum("grn,ngd->grd", p, vv).reshape(n_heads, dim))
    return torch.stack(result).to(q.dtype)

# %% answer="sliding_window_mask"
def sliding_window_mask(q_len, kv_len, window):
    if window < 1:
        raise ValueError(f"window must be >= 1, got window = {window}")
    ones = torch.ones(q_len, kv_len, dtype=torch.bool)
    shift = kv_len - q_len
    return torch.tril(ones, diagonal=shift) & torch.triu(ones, diagonal=shift - window + 1)

# %% answer="attention_with_sinks"
def attention_with_sinks(q, k, v, sinks, window=None, scale=None):
    s_q, s_k = q.shape[-2], k.shape[-2]
    sm_scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * sm_scale
    visible = sliding_window_mask(s_q, s_k, window if window is not None else max(s_k, 1) + s_q)
    logits = logits.masked_fill(~visible.to(q.device), float("-inf"))
    sink = sinks.float().to(q.device)[None, :, None, None].expand(*logits.shape[:-1], 1)
    # logsumexp over the scores and the sink; a row of nothing (sink -inf, no key) gives 0
    lse = torch.logsumexp(torch.cat([logits, sink], dim=-1), dim=-1, keepdim=True)
    probs = torch.exp(logits - lse.nan_to_num(neginf=0.0)).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v.float()).to(q.dtype)

# %% answer="streaming_kept_positions"
def streaming_kept_positions(seq_len, n_sink, n_recent):
    if seq_len < 0 or n_sink < 0 or n_recent < 0:
        raise ValueError(f"negative size: seq_len={seq_len}, n_sink={n_sink}, n_recent={n_recent}")
    everything = torch.arange(seq_len)
    keep = (everything < n_sink) | (everything >= seq_len - n_recent)
    return everything[keep]

# %% answer="streaming_decode"
def streaming_decode(q_raw, k_raw, v, n_sink, n_recent, rope_base=10000.0):
    def rope(x, positions):
        dim = x.shape[-1]
        inv = rope_base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim)
        ang = positions.to(device=x.device, dtype=torch.float64)[:, None] * inv
        cos, sin = ang.cos().float(), ang.sin().float()
        even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

    kept = streaming_kept_positions(k_raw.shape[2], n_sink, n_recent).to(k_raw.device)
    n = kept.numel()
    keys = rope(k_raw[:, :, kept], torch.arange(n))
    query = rope(q_raw[:, :, None, :], torch.tensor([n - 1]))
    weights = torch.softmax(torch.einsum("bhqd,bhkd->bhqk", query, keys) / math.sqrt(q_raw.shape[-1]), -1)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v[:, :, kept].float())[:, :, 0].to(q_raw.dtype)

# %% answer="mla_cache_entry"
def mla_cache_entry(x, w, positions):
    down = F.linear(x, w.w_dkv)
    latent = F.rms_norm(down[..., :w.kv_lora_rank], (w.kv_lora_rank,), w.kv_norm_weight, w.norm_eps)
    return latent, apply_rope_at(down[..., w.kv_lora_rank:], positions, w.rope_base)

# %% answer="mla_attention_naive"
def mla_attention_naive(x, w, latent, k_pe, positions):
    bsz, t_q, _ = x.shape
    t_k = latent.shape[1]
    n_h, d_n, d_r, d_v = w.n_heads, w.qk_nope_dim, w.qk_rope_dim, w.v_dim
    q = F.linear(x, w.w_q).unflatten(-1, (n_h, d_n + d_r))  # [B, T_q, H, d_n + d_r]
    q_nope, q_pe = q[..., :d_n], apply_rope_at(q[..., d_n:].transpose(1, 2), positions, w.rope_base)
    kv = F.linear(latent, w.w_ukv).unflatten(-1, (n_h, d_n + d_v))  # [B, T_k, H, d_n + d_v]
    k_nope, value = kv[..., :d_n], kv[..., d_n:]
    logits = (torch.einsum("bqhn,bkhn->bhqk", q_nope, k_nope)
              + torch.einsum("bhqr,bkr->bhqk", q_pe, k_pe)) / math.sqrt(d_n + d_r)
    future = torch.ones(t_q, t_k, dtype=torch.bool, device=x.device).triu(t_k - t_q + 1)
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    heads = torch.einsum("bhqk,bkhv->bqhv", probs, value).reshape(bsz, t_q, n_h * d_v)
    return F.linear(heads, w.w_o)

# %% answer="mla_attention_absorbed"
def mla_attention_absorbed(x, w, latent, k_pe, positions):
    bsz, t_q, _ = x.shape
    t_k = latent.shape[1]
    n_h, d_n, d_r, d_v = w.n_heads, w.qk_nope_dim, w.qk_rope_dim, w.v_dim
    q = F.linear(x, w.w_q).unflatten(-1, (n_h, d_n + d_r))
    q_pe = apply_rope_at(q[..., d_n:].transpose(1, 2), positions, w.rope_base)  # [B, H, T_q, d_r]
    up = w.w_ukv.unflatten(0, (n_h, d_n + d_v))  # [H, d_n + d_v, rank]
    q_absorbed = torch.einsum("bqhn,hnr->bhqr", q[..., :d_n], up[:, :d_n])
    logits = (torch.einsum("bhqr,bkr->bhqk", q_absorbed, latent)
              + torch.einsum("bhqr,bkr->bhqk", q_pe, k_pe)) / math.sqrt(d_n + d_r)
    future = torch.ones(t_q, t_k, dtype=torch.bool, device=x.device).triu(t_k - t_q + 1)
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    mixed = torch.einsum("bhqk,bkr->bhqr", probs, latent)
    heads = torch.einsum("bhqr,hvr->bqhv", mixed, up[:, d_n:]).reshape(bsz, t_q, n_h * d_v)
    return F.linear(heads, w.w_o)

# %% answer="mla_cache_bytes"
def mla_cache_bytes(num_layers, kv_lora_rank, qk_rope_dim, seq_len, batch_size, bytes_per_element):
    per_token = (kv_lora_rank + qk_rope_dim) * bytes_per_element
    return int(math.ceil(num_layers * seq_len * batch_size * per_token))

# %% answer="tree_attention_mask"
def tree_attention_mask(parents, prefix_len):
    parents = torch.as_tensor(parents, dtype=torch.long).tolist()
    if prefix_len < 0:
        raise ValueError(f"prefix_len = {prefix_len} < 0")
    n = len(parents)
    ancestors = torch.eye(n, dtype=torch.bool)  # each node is its own ancestor
    for node, parent in enumerate(parents):
        if parent < -1 or parent >= node:
            raise ValueError(f"parent {parent} of node {node} is not an earlier node (or -1)")
        if parent >= 0:
            ancestors[node] |= ancestors[parent]
    return torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), ancestors], dim=1)

# %% answer="tree_position_ids"
def tree_position_ids(parents, prefix_len):
    parents = torch.as_tensor(parents, dtype=torch.long).tolist()
    depth = [0] * len(parents)
    for node, parent in enumerate(parents):
        depth[node] = depth[parent] + 1 if parent >= 0 else 0
    return torch.tensor(depth, dtype=torch.long) + prefix_len
