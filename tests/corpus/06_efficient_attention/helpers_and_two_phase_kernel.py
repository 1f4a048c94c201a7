# Correct answers in another style: helper functions with common names (`attention`, `softmax`),
# -inf masks with torch.where, chunks from enumerate(split), in-place updates, a flash pass that
# pads nothing and indexes tiles with slices of precomputed positions, and a kernel that splits
# the causal loop in two phases (tiles below the diagonal without a mask, then the diagonal ones)
# with a @triton.jit helper.

# %% answer="attention_matrix_bytes"
def attention_matrix_bytes(batch_size, num_heads, seq_len, bytes_per_element):
    per_head = seq_len * seq_len * bytes_per_element
    return per_head * num_heads * batch_size

# %% answer="chunked_attention"
def softmax(x, dim=-1):
    shifted = x - x.amax(dim=dim, keepdim=True)
    e = shifted.exp()
    return e / e.sum(dim=dim, keepdim=True)


def attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is None:
        return softmax(scores) @ v
    weights = softmax(torch.where(mask, scores, torch.full_like(scores, float("-inf"))))
    # a query that sees no key: its softmax is 0 / 0; SDPA gives it 0
    return torch.where(mask.any(dim=-1, keepdim=True), weights, torch.zeros_like(weights)) @ v


def chunked_attention(q, k, v, chunk_size, causal=False):
    offset = k.shape[-2] - q.shape[-2]
    key_positions = torch.arange(k.shape[-2], device=q.device)
    result = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    for index, rows in enumerate(q.split(chunk_size, dim=-2)):
        start = index * chunk_size
        mask = None
        if causal:
            query_positions = torch.arange(start, start + rows.shape[-2], device=q.device)
            mask = key_positions.unsqueeze(0) <= query_positions.unsqueeze(1) + offset
        result[..., start:start + rows.shape[-2], :] = attention(rows, k, v, mask=mask)
    return result

# %% answer="streaming_logsumexp"
def streaming_logsumexp(x, block_size):
    shape = x.shape[:-1]
    m = torch.full(shape, -math.inf, dtype=x.dtype, device=x.device)
    s = torch.zeros(shape, dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[-1], block_size):
        chunk = x[..., start:min(start + block_size, x.shape[-1])]
        m_new = torch.maximum(m, chunk.max(dim=-1).values)
        ok = torch.isfinite(m_new)
        shift = torch.where(ok, m_new, torch.zeros_like(m_new))
        s.mul_(torch.where(ok, torch.exp(m - shift), torch.zeros_like(s)))
        s.add_(torch.exp(chunk - shift.unsqueeze(-1)).sum(dim=-1))
        m = m_new
    return torch.where(s > 0, m + torch.log(s), torch.full_like(s, -math.inf))

# %% answer="online_softmax_step"
def online_softmax_step(m, l, acc, scores_block, v_block):
    new_max = torch.maximum(m, scores_block.max(-1).values)
    decay = (m - new_max).exp()
    weights = (scores_block - new_max[..., None]).exp()
    acc = acc * decay[..., None]
    acc += weights @ v_block
    l = l * decay + weights.sum(-1)
    return new_max, l, acc

# %% answer="flash_attention_forward"
def flash_attention_forward(q, k, v, block_q=64, block_k=64, causal=False, scale=None):
    *batch_heads, n_q, head_dim = q.shape
    n_k = k.shape[-2]
    scale = head_dim ** -0.5 if scale is None else scale
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_pos = torch.arange(n_q, device=q.device) + (n_k - n_q)  # the last key each query may see
    k_pos = torch.arange(n_k, device=q.device)
    out = torch.zeros(*batch_heads, n_q, v.shape[-1], dtype=compute_dtype, device=q.device)
    lse = torch.zeros(*batch_heads, n_q, dtype=compute_dtype, device=q.device)
    for q0 in range(0, n_q, block_q):
        q1 = min(q0 + block_q, n_q)
        q_tile = q[..., q0:q1, :].to(compute_dtype)
        m = torch.full((*batch_heads, q1 - q0), -math.inf, dtype=compute_dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*batch_heads, q1 - q0, v.shape[-1], dtype=compute_dtype, device=q.device)
        k_limit = min(n_k, int(q_pos[q1 - 1]) + 1) if causal else n_k
        for k0 in range(0, k_limit, block_k):
            k1 = min(k0 + block_k, n_k)
            s = (q_tile @ k[..., k0:k1, :].to(compute_dtype).mT) * scale
            if causal:
                s = s.masked_fill(k_pos[k0:k1][None, :] > q_pos[q0:q1][:, None], -math.inf)
            m, l, acc = online_softmax_step(m, l, acc, s, v[..., k0:k1, :].to(compute_dtype))
        sees_a_key = q_pos[q0:q1] >= 0 if causal else torch.ones(q1 - q0, dtype=torch.bool, device=q.device)
        out[..., q0:q1, :] = torch.where(sees_a_key[:, None], acc / l.unsqueeze(-1), 0.0)
        lse[..., q0:q1] = torch.where(sees_a_key, m + torch.log(l), -math.inf)
    return out.to(q.dtype), lse

# %% answer="flash_attention_kernel"
@triton.jit
def _online_update(m_i, l_i, acc, s, v):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    correction = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * correction + tl.sum(p, axis=1)
    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def flash_attention_kernel(Q, K, V, Out, Lse,
                           stride_qh, stride_qs, stride_kh, stride_ks, stride_vh, stride_vs,
                           seq_q, seq_k, sm_scale,
                           CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                           HEAD_DIM: tl.constexpr):
    """Two phases: key tiles every query of the block may see in full, then the rest, masked."""
    block_index = tl.program_id(0)
    head_index = tl.program_id(1)
    offs_q = block_index * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + head_index * stride_qh + offs_q[:, None] * stride_qs + offs_d[None, :],
                mask=offs_q[:, None] < seq_q, other=0.0)
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    offset = seq_k - seq_q
    full_end = (seq_k // BLOCK_K) * BLOCK_K  # tiles entirely inside the keys
    end = seq_k
    if CAUSAL:
        # keys every row of this block may see: j <= first row + offset
        full_end = tl.minimum(full_end, tl.maximum(block_index * BLOCK_Q + offset + 1, 0) // BLOCK_K * BLOCK_K)
        end = tl.minimum(seq_k, (block_index + 1) * BLOCK_Q + offset)
    for start in range(0, full_end, BLOCK_K):  # phase 1: no mask needed
        keys = start + tl.arange(0, BLOCK_K)
        k = tl.load(K + head_index * stride_kh + keys[:, None] * stride_ks + offs_d[None, :])
        v = tl.load(V + head_index * stride_vh + keys[:, None] * stride_vs + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        m_i, l_i, acc = _online_update(m_i, l_i, acc, s, v)
    for start in range(full_end, end, BLOCK_K):  # phase 2: the diagonal and the ragged end
        keys = start + tl.arange(0, BLOCK_K)
        k = tl.load(K + head_index * stride_kh + keys[:, None] * stride_ks + offs_d[None, :],
                    mask=keys[:, None] < seq_k, other=0.0)
        v = tl.load(V + head_index * stride_vh + keys[:, None] * stride_vs + offs_d[None, :],
                    mask=keys[:, None] < seq_k, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        visible = keys[None, :] < seq_k
        if CAUSAL:
            visible = visible & (keys[None, :] <= offs_q[:, None] + offset)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_update(m_i, l_i, acc, s, v)
    sees_a_key = offs_q >= 0  # the given epilogue: a query that sees no key gets out 0, lse -inf
    if CAUSAL:
        sees_a_key = offs_q >= seq_q - seq_k
    acc = tl.where(sees_a_key[:, None], acc / l_i[:, None], 0.0)
    lse = tl.where(sees_a_key, (m_i + tl.log2(l_i)) * 0.6931471805599453, float("-inf"))
    row_ok = offs_q < seq_q
    tl.store(Out + head_index * stride_qh + offs_q[:, None] * stride_qs + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + head_index * seq_q + offs_q, lse, mask=row_ok)

# %% answer="flash_attention_backward"
def tile_probabilities(q_tile, k_tile, lse_rows, scale, hidden=None):
    scores = (q_tile.unsqueeze(-2) * k_tile.unsqueeze(-3)).sum(-1) * scale  # what @ computes: Σ_d q_d k_d
    if hidden is not None:
        scores = torch.where(hidden, torch.full_like(scores, -math.inf), scores)
        # hidden keys get P = 0, also where lse = -inf (a query that sees no key: exp(-inf + inf) is NaN)
        return torch.where(hidden, torch.zeros_like(scores), (scores - lse_rows.unsqueeze(-1)).exp())
    return (scores - lse_rows.unsqueeze(-1)).exp()


def softmax_backward(p, dp, delta):
    return p * (dp - delta.unsqueeze(-1))


def flash_attention_backward(q, k, v, out, lse, dout, block_q=64, block_k=64, causal=False, scale=None):
    *batch_heads, n_q, head_dim = q.shape
    n_k = k.shape[-2]
    scale = head_dim ** -0.5 if scale is None else scale
    dtypes = (q.dtype, k.dtype, v.dtype)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, out, dout, lse = (t.to(dt) for t in (q, k, v, out, dout, lse))
    q_pos = torch.arange(n_q, device=q.device) + (n_k - n_q)  # the last key each query may see
    k_pos = torch.arange(n_k, device=q.device)
    delta = torch.sum(dout * out, dim=-1)
    dq = torch.zeros_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for k0 in range(0, n_k, block_k):
        k1 = min(k0 + block_k, n_k)
        dk_acc = torch.zeros_like(k[..., k0:k1, :])
        dv_acc = torch.zeros_like(v[..., k0:k1, :])
        first_q = max(0, k0 - (n_k - n_q)) if causal else 0  # earlier queries see none of these keys
        for q0 in range((first_q // block_q) * block_q, n_q, block_q):
            q1 = min(q0 + block_q, n_q)
            hidden = (k_pos[k0:k1][None, :] > q_pos[q0:q1][:, None]) if causal else None
            p = tile_probabilities(q[..., q0:q1, :], k[..., k0:k1, :], lse[..., q0:q1], scale, hidden)
            dv_acc += p.mT @ dout[..., q0:q1, :]
            ds = softmax_backward(p, dout[..., q0:q1, :] @ v[..., k0:k1, :].mT, delta[..., q0:q1])
            dq[..., q0:q1, :] += ds @ k[..., k0:k1, :] * scale
            dk_acc += ds.mT @ q[..., q0:q1, :] * scale
        dk[..., k0:k1, :] = dk_acc
        dv[..., k0:k1, :] = dv_acc
    return tuple(t.to(dtype) for t, dtype in zip((dq, dk, dv), dtypes))

# %% answer="FlashAttention"
class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        result, logsumexp = flash_attention_forward(q, k, v, causal=causal)
        ctx.mark_non_differentiable(logsumexp)
        ctx.save_for_backward(q, k, v, result, logsumexp)
        ctx.is_causal = causal
        return result

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        return (*flash_attention_backward(*saved, grad.contiguous(), causal=ctx.is_causal), None)


def flash_attention(q, k, v, causal=False):
    return FlashAttention.apply(q, k, v, causal)

# %% answer="scale_kernel"
@triton.jit
def _block_offsets(BLOCK: tl.constexpr):
    return tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def scale_kernel(X, Out, n, alpha, BLOCK: tl.constexpr):
    offs = _block_offsets(BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    y = tl.where(offs < n, x * alpha, 0.0)
    tl.store(Out + offs, y, mask=offs < n)

# %% answer="matmul_kernel"
@triton.jit
def _load_tile(base, rows, cols, n_rows, n_cols, stride_r, stride_c):
    return tl.load(base + rows[:, None] * stride_r + cols[None, :] * stride_c,
                   mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def matmul_kernel(A, B, C, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        inner = start + tl.arange(0, BLOCK_K)
        total += tl.dot(_load_tile(A, rows, inner, M, K, stride_am, stride_ak),
                        _load_tile(B, inner, cols, K, N, stride_bk, stride_bn))
    tl.store(C + rows[:, None] * stride_cm + cols[None, :] * stride_cn, total,
             mask=(rows[:, None] < M) & (cols[None, :] < N))

# %% answer="row_softmax_kernel"
@triton.jit
def _stable_exp(x):
    return tl.exp(x - tl.max(x, axis=0))


@triton.jit
def row_softmax_kernel(X, Out, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    scores = tl.load(X + tl.program_id(0) * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
    weights = _stable_exp(scores)
    weights = weights / tl.sum(weights, axis=0)
    tl.store(Out + tl.program_id(0) * stride_out + cols, weights, mask=mask)

# %% answer="online_softmax_kernel"
@triton.jit
def _rescaled(m_old, l_old, scores):
    m_new = tl.maximum(m_old, tl.max(scores, axis=0))
    return m_new, l_old * tl.exp(m_old - m_new) + tl.sum(tl.exp(scores - m_new), axis=0)


@triton.jit
def online_softmax_kernel(X, Out, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    l = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)  # noqa: E741 (the paper's name)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        scores = tl.load(X + row * stride_x + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m, l = _rescaled(m, l, scores)  # noqa: E741
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        scores = tl.load(X + row * stride_x + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        weights = tl.exp(scores - m) / l
        tl.store(Out + row * stride_out + start + cols, weights.to(Out.dtype.element_ty), mask=mask)

# %% answer="flash_attention_backward_kernel"
@triton.jit
def _tile_p_ds(q, k, v, do, lse, delta, offs_q, offs_k, seq_q, seq_k, sm_scale, CAUSAL: tl.constexpr):
    s = tl.dot(q, tl.trans(k)) * sm_scale
    visible = (offs_q[:, None] < seq_q) & (offs_k[None, :] < seq_k)
    if CAUSAL:
        visible = visible & (offs_k[None, :] <= offs_q[:, None] + seq_k - seq_q)
    p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
    ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    return p, ds


@triton.jit
def flash_attention_backward_kernel(Q, K, V, DO, Lse, Delta, DK, DV,
                                    stride_qh, stride_qs, stride_kh, stride_ks, stride_vh, stride_vs,
                                    seq_q, seq_k, sm_scale, CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                                    BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr):
    key_block = tl.program_id(0)
    head_index = tl.program_id(1)
    offs_k = key_block * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_k < seq_k
    k = tl.load(K + head_index * stride_kh + offs_k[:, None] * stride_ks + offs_d[None, :],
                mask=key_ok[:, None], other=0.0)
    v = tl.load(V + head_index * stride_vh + offs_k[:, None] * stride_vs + offs_d[None, :],
                mask=key_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_K, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM], dtype=tl.float32)
    q_start_first = 0
    if CAUSAL:  # queries before key_block·BLOCK_K − (S_k − S_q) see none of these keys
        q_start_first = tl.maximum(0, key_block * BLOCK_K - (seq_k - seq_q)) // BLOCK_Q * BLOCK_Q
    for q_start in range(q_start_first, seq_q, BLOCK_Q):
        offs_q = q_start + tl.arange(0, BLOCK_Q)
        row_ok = offs_q < seq_q
        rows = head_index * stride_qh + offs_q[:, None] * stride_qs + offs_d[None, :]
        q = tl.load(Q + rows, mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + rows, mask=row_ok[:, None], other=0.0)
        lse = tl.load(Lse + head_index * seq_q + offs_q, mask=row_ok, other=0.0)
        delta = tl.load(Delta + head_index * seq_q + offs_q, mask=row_ok, other=0.0)
        p, ds = _tile_p_ds(q, k, v, do, lse, delta, offs_q, offs_k, seq_q, seq_k, sm_scale, CAUSAL)
        dv += tl.dot(tl.trans(p).to(do.dtype), do)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q)
    dk = dk * sm_scale
    cols = offs_k[:, None] * stride_ks + offs_d[None, :]
    tl.store(DK + head_index * stride_kh + cols, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + head_index * stride_vh + cols, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def flash_attention_backward_dq_kernel(Q, K, V, DO, Lse, Delta, DQ,
                                       stride_qh, stride_qs, stride_kh, stride_ks, stride_vh, stride_vs,
                                       seq_q, seq_k, sm_scale, CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                                       BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr):
    block_index = tl.program_id(0)
    head_index = tl.program_id(1)
    offs_q = block_index * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_q < seq_q
    rows = head_index * stride_qh + offs_q[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(Q + rows, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + rows, mask=row_ok[:, None], other=0.0)
    lse = tl.load(Lse + head_index * seq_q + offs_q, mask=row_ok, other=0.0)
    delta = tl.load(Delta + head_index * seq_q + offs_q, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    k_stop = seq_k
    if CAUSAL:
        k_stop = tl.minimum(seq_k, (block_index + 1) * BLOCK_Q + seq_k - seq_q)
    for k_start in range(0, k_stop, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        key_ok = offs_k < seq_k
        k = tl.load(K + head_index * stride_kh + offs_k[:, None] * stride_ks + offs_d[None, :],
                    mask=key_ok[:, None], other=0.0)
        v = tl.load(V + head_index * stride_vh + offs_k[:, None] * stride_vs + offs_d[None, :],
                    mask=key_ok[:, None], other=0.0)
        p, ds = _tile_p_ds(q, k, v, do, lse, delta, offs_q, offs_k, seq_q, seq_k, sm_scale, CAUSAL)
        dq += tl.dot(ds.to(k.dtype), k)
    dq = dq * sm_scale
    tl.store(DQ + rows, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])

# %% answer="ANSWER_BACKWARD_FLOPS"
forward_products = 2  # q kᵀ, P v
fa2 = ["q kᵀ", "Pᵀ dO", "dO vᵀ", "dS k", "dSᵀ q"]
two_kernels = ["q kᵀ", "Pᵀ dO", "dO vᵀ", "dSᵀ q"] + ["q kᵀ", "dO vᵀ", "dS k"]
ANSWER_BACKWARD_FLOPS = [len(fa2) / forward_products, len(two_kernels) / forward_products]
