# Correct answers in another style: SDPA on each chunk with an explicit mask, exp2 with log2(e)
# factors everywhere (natural-log results), einops, keyword calls, the Triton tutorial's kernel
# (pointers advanced each step, a finite -1e6 for masked scores, tl.math.exp2).

# %% answer="attention_matrix_bytes"
def attention_matrix_bytes(batch_size, num_heads, seq_len, bytes_per_element):
    elements = batch_size * num_heads * seq_len ** 2
    return int(elements * bytes_per_element)

# %% answer="chunked_attention"
def chunked_attention(q, k, v, chunk_size, causal=False):
    seq_q, seq_k = q.shape[2], k.shape[2]
    outputs = []
    for chunk_index in range(math.ceil(seq_q / chunk_size)):
        start = chunk_index * chunk_size
        stop = min(start + chunk_size, seq_q)
        mask = None
        if causal:
            query_pos = torch.arange(start, stop, device=q.device)
            key_pos = torch.arange(seq_k, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None] + (seq_k - seq_q)
        outputs.append(F.scaled_dot_product_attention(q[:, :, start:stop], k, v, attn_mask=mask))
    return torch.cat(outputs, dim=2)

# %% answer="streaming_logsumexp"
def streaming_logsumexp(x, block_size):
    log2e = 1.4426950408889634
    running_max = x.new_full(x.shape[:-1], float("-inf"))
    running_sum = x.new_zeros(x.shape[:-1])
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size] * log2e  # base-2 units
        new_max = torch.maximum(running_max, block.amax(-1))
        anchor = torch.nan_to_num(new_max, neginf=0.0)
        running_sum = running_sum * torch.exp2(running_max - anchor) + torch.exp2(block - anchor[..., None]).sum(-1)
        running_max = new_max
    return (running_max + torch.log2(running_sum)) / log2e

# %% answer="online_softmax_step"
def online_softmax_step(m, l, acc, scores_block, v_block):
    log2e = 1.4426950408889634
    m_new = torch.maximum(m, torch.amax(scores_block, dim=-1))
    alpha = torch.exp2((m - m_new) * log2e)
    p = torch.exp2((scores_block - m_new.unsqueeze(-1)) * log2e)
    return m_new, alpha * l + p.sum(-1), alpha.unsqueeze(-1) * acc + torch.matmul(p, v_block)

# %% answer="flash_attention_forward"
from einops import rearrange


def flash_attention_forward(q, k, v, block_q=64, block_k=64, causal=False, scale=None):
    dtype = torch.promote_types(q.dtype, torch.float32)
    sm_scale = q.shape[-1] ** -0.5 if scale is None else scale
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    out_blocks, lse_blocks = [], []
    for q_index, q_blk in enumerate(q.to(dtype).split(block_q, dim=2)):
        q_lo = q_index * block_q
        q_hi = q_lo + q_blk.shape[2]
        state = (q_blk.new_full(q_blk.shape[:-1], -math.inf), q_blk.new_zeros(q_blk.shape[:-1]),
                 q_blk.new_zeros(*q_blk.shape[:-1], v.shape[-1]))
        for k_lo in range(0, seq_k, block_k):
            if causal and k_lo > q_hi - 1 + seq_k - seq_q:
                break  # this and all later key blocks are in every query's future
            k_blk = k[:, :, k_lo:k_lo + block_k].to(dtype)
            v_blk = v[:, :, k_lo:k_lo + block_k].to(dtype)
            s = rearrange(q_blk, "b h i d -> b h i d") @ rearrange(k_blk, "b h j d -> b h d j") * sm_scale
            if causal:
                keep = (torch.arange(k_lo, k_lo + k_blk.shape[2], device=q.device)[None, :]
                        <= torch.arange(q_lo, q_hi, device=q.device)[:, None] + seq_k - seq_q)
                s = torch.where(keep, s, torch.tensor(-math.inf, dtype=dtype, device=q.device))
            state = online_softmax_step(m=state[0], l=state[1], acc=state[2], scores_block=s, v_block=v_blk)
        m, l, acc = state
        saw_a_key = torch.isfinite(m)  # a query that sees no key keeps m = -inf: out 0, lse -inf
        out_blocks.append(torch.where(saw_a_key[..., None], acc / l.unsqueeze(-1), 0.0))
        lse_blocks.append(torch.where(saw_a_key, m + l.log(), -math.inf))
    return torch.cat(out_blocks, dim=2).type_as(q), torch.cat(lse_blocks, dim=2)

# %% answer="flash_attention_kernel"
@triton.jit
def flash_attention_kernel(Q, K, V, Out, Lse,
                           stride_qh, stride_qs, stride_kh, stride_ks, stride_vh, stride_vs,
                           seq_q, seq_k, sm_scale,
                           CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                           HEAD_DIM: tl.constexpr):
    """The tutorial's loop: K and V pointers advanced by BLOCK_K rows each step."""
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
    offs_n = tl.arange(0, BLOCK_K)
    k_ptrs = K + head_index * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V + head_index * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :]
    hi = seq_k
    if CAUSAL:
        hi = tl.minimum(seq_k, (block_index + 1) * BLOCK_Q + seq_k - seq_q)
    for start_n in range(0, hi, BLOCK_K):
        cols = start_n + offs_n
        kv_mask = cols[:, None] < seq_k
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k))
        keep = cols[None, :] < seq_k
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_q[:, None] + (seq_k - seq_q))
        qk = tl.where(keep, qk * qk_scale, -1.0e6)
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        acc += tl.dot(p.to(v.dtype), v)
        m_i = m_ij
        k_ptrs += BLOCK_K * stride_ks
        v_ptrs += BLOCK_K * stride_vs
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
def flash_attention_backward(q, k, v, out, lse, dout, block_q=64, block_k=64, causal=False, scale=None):
    # exp2 with log2(e) factors, einops to [B·H, S, d], keyword calls, torch.where for the mask,
    # index_add_ for dQ, a helper for one tile.
    LOG2E = 1.0 / math.log(2.0)
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    sm_scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32)
    flat = [rearrange(t, "b h s d -> (b h) s d").to(dtype) for t in (q, k, v, out, dout)]
    q2, k2, v2, o2, do2 = flat
    # clamped: a query that sees no key has lse = -inf, and exp2(-inf - (-inf)) would be NaN, not its P = 0
    lse2 = (rearrange(lse, "b h s -> (b h) s").to(dtype) * LOG2E).clamp(min=torch.finfo(dtype).min)
    delta = (do2 * o2).sum(dim=-1, keepdim=True)
    dq2, dk2, dv2 = torch.zeros_like(q2), torch.zeros_like(k2), torch.zeros_like(v2)

    def tile(qs, qe, ks, ke):
        s2 = torch.bmm(q2[:, qs:qe], k2[:, ks:ke].transpose(1, 2)) * (sm_scale * LOG2E)
        if causal:
            keep = torch.arange(ks, ke)[None, :] <= torch.arange(qs, qe)[:, None] + (n_k - n_q)
            s2 = torch.where(keep.to(s2.device), s2, torch.full_like(s2, float("-inf")))
        return torch.exp2(s2 - lse2[:, qs:qe, None])

    for ks in range(0, n_k, block_k):
        ke = min(ks + block_k, n_k)
        for qs in range(0, n_q, block_q):
            qe = min(qs + block_q, n_q)
            if causal and ks >= qe + n_k - n_q:
                continue
            p = tile(qs, qe, ks, ke)
            dv2[:, ks:ke] += torch.bmm(p.transpose(1, 2), do2[:, qs:qe])
            ds = p * (torch.bmm(do2[:, qs:qe], v2[:, ks:ke].transpose(1, 2)) - delta[:, qs:qe])
            dq2.index_add_(1, torch.arange(qs, qe, device=q.device), sm_scale * torch.bmm(ds, k2[:, ks:ke]))
            dk2[:, ks:ke] += sm_scale * torch.bmm(ds.transpose(1, 2), q2[:, qs:qe])
    unflat = [rearrange(t, "(b h) s d -> b h s d", b=b) for t in (dq2, dk2, dv2)]
    return unflat[0].to(q.dtype), unflat[1].to(k.dtype), unflat[2].to(v.dtype)

# %% answer="FlashAttention"
class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, causal=False):
        output, logsumexp = flash_attention_forward(query, key, value, block_q=16, block_k=16, causal=causal)
        ctx.save_for_backward(query, key, value, output, logsumexp)
        ctx.causal = causal
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, logsumexp = ctx.saved_tensors
        d_query, d_key, d_value = flash_attention_backward(
            query, key, value, output, logsumexp, grad_output, block_q=16, block_k=16, causal=ctx.causal)
        return d_query, d_key, d_value, None


def flash_attention(q, k, v, causal=False):
    return FlashAttention.apply(q, k, v, causal)

# %% answer="scale_kernel"
@triton.jit
def scale_kernel(X, Out, n, alpha, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    keep = pid * BLOCK + lanes < n
    ptr_in = X + pid * BLOCK + lanes
    tl.store(Out + pid * BLOCK + lanes, tl.load(ptr_in, mask=keep, other=0.0) * alpha, mask=keep)

# %% answer="matmul_kernel"
@triton.jit
def matmul_kernel(A, B, C, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # float32 products of each block (inputs upcast), accumulated with +=, a while-style loop
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k0 = 0
    while k0 < K:
        kk = k0 + tl.arange(0, BLOCK_K)
        a_blk = tl.load(A + i[:, None] * stride_am + kk[None, :] * stride_ak,
                        mask=(i[:, None] < M) & (kk[None, :] < K), other=0.0).to(tl.float32)
        b_blk = tl.load(B + kk[:, None] * stride_bk + j[None, :] * stride_bn,
                        mask=(kk[:, None] < K) & (j[None, :] < N), other=0.0).to(tl.float32)
        acc += tl.dot(a_blk, b_blk)
        k0 += BLOCK_K
    tl.store(C + i[:, None] * stride_cm + j[None, :] * stride_cn, acc, mask=(i[:, None] < M) & (j[None, :] < N))

# %% answer="row_softmax_kernel"
@triton.jit
def row_softmax_kernel(X, Out, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    # exp2 with log2(e), the masked lanes zeroed after the exponential instead of loaded as -inf
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    valid = c < n_cols
    x = tl.load(X + r * stride_x + c, mask=valid, other=-1.0e30)
    m = tl.max(tl.where(valid, x, -1.0e30), axis=0)
    p = tl.where(valid, tl.exp2((x - m) * 1.4426950408889634), 0.0)
    tl.store(Out + r * stride_out + c, p / tl.sum(p, axis=0), mask=valid)

# %% answer="online_softmax_kernel"
@triton.jit
def online_softmax_kernel(X, Out, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    # base 2 throughout, masked lanes loaded as 0, kept out of the max by a finite -1e30 and zeroed after
    # the exponential
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], -1.0e30, tl.float32), axis=0)  # in log2 units
    l = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)  # noqa: E741
    for start in range(0, n_cols, BLOCK):
        valid = start + c < n_cols
        x = tl.load(X + r * stride_x + start + c, mask=valid, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m, tl.max(tl.where(valid, x, -1.0e30), axis=0))
        p = tl.where(valid, tl.math.exp2(x - m_new), 0.0)
        l = l * tl.math.exp2(m - m_new) + tl.sum(p, axis=0)  # noqa: E741
        m = m_new
    for start in range(0, n_cols, BLOCK):
        valid = start + c < n_cols
        x = tl.load(X + r * stride_x + start + c, mask=valid, other=0.0).to(tl.float32) * 1.4426950408889634
        tl.store(Out + r * stride_out + start + c, tl.math.exp2(x - m) / l, mask=valid)

# %% answer="flash_attention_backward_kernel"
# exp2 with log2(e), the scale folded into dS, the launcher's kernels as given
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
        s = tl.dot(q, tl.trans(k)) * sm_scale  # [BLOCK_Q, BLOCK_K]
        visible = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_k[None, :] <= offs_q[:, None] + seq_k - seq_q)
        p = tl.where(visible, tl.exp2((s - lse[:, None]) * 1.4426950408889634), 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds * sm_scale).to(q.dtype), q)
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
        s = tl.dot(q, tl.trans(k)) * sm_scale
        visible = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_k[None, :] <= offs_q[:, None] + seq_k - seq_q)
        p = tl.where(visible, tl.exp2((s - lse[:, None]) * 1.4426950408889634), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot((ds * sm_scale).to(k.dtype), k)
    tl.store(DQ + rows, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])

# %% answer="ANSWER_BACKWARD_FLOPS"
ANSWER_BACKWARD_FLOPS = (5 / 2, 3.5)  # 5 and 7 products of S²·d against the forward's 2
