# Correct answers in another style: float32 internals cast back, einsum, -1e9 / finfo.min masks,
# logaddexp of block logsumexps, while loops over [B·H, S, d] with bmm, natural exp in the kernel.

# %% answer="attention_matrix_bytes"
def attention_matrix_bytes(batch_size, num_heads, seq_len, bytes_per_element):
    return math.prod((batch_size, num_heads, seq_len, seq_len, bytes_per_element))

# %% answer="chunked_attention"
def chunked_attention(q, k, v, chunk_size, causal=False):
    n_q, n_k = q.size(-2), k.size(-2)
    kf, vf = k.float(), v.float()
    pieces = []
    for first in range(0, n_q, chunk_size):
        qc = q[:, :, first:first + chunk_size].float()
        logits = torch.einsum("bhid,bhjd->bhij", qc, kf) / math.sqrt(q.size(-1))
        if causal:
            i = torch.arange(first, first + qc.size(-2), device=q.device).unsqueeze(1)
            j = torch.arange(n_k, device=q.device).unsqueeze(0)
            logits = logits.masked_fill(j - i > n_k - n_q, -1e9)
        pieces.append(torch.einsum("bhij,bhjd->bhid", logits.softmax(dim=-1), vf))
    result = torch.cat(pieces, dim=2)
    if causal and n_q > n_k:  # the first n_q - n_k queries see no key: 0, as SDPA (-1e9 gave them a mean)
        result[:, :, :n_q - n_k] = 0.0
    return result.to(q.dtype)

# %% answer="streaming_logsumexp"
def streaming_logsumexp(x, block_size):
    total = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    for block in torch.split(x, block_size, dim=-1):
        total = torch.logaddexp(total, torch.logsumexp(block, dim=-1))
    return total

# %% answer="online_softmax_step"
def online_softmax_step(m, l, acc, scores_block, v_block):
    dtype = acc.dtype
    m32, l32, acc32 = m.float(), l.float(), acc.float()
    s32 = scores_block.float()
    m_next = torch.max(m32, s32.max(dim=-1).values)
    rescale = torch.exp(m32 - m_next)
    weights = torch.exp(s32 - m_next.unsqueeze(-1))
    l32 = l32 * rescale + weights.sum(dim=-1)
    acc32 = acc32 * rescale.unsqueeze(-1) + torch.einsum("...ij,...jd->...id", weights, v_block.float())
    return m_next.to(dtype), l32.to(dtype), acc32.to(dtype)

# %% answer="flash_attention_forward"
def flash_attention_forward(q, k, v, block_q=64, block_k=64, causal=False, scale=None):
    b, h, n_q, _ = q.shape
    n_k, d_v = k.shape[2], v.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q3 = q.reshape(b * h, n_q, -1).float()
    k3 = k.reshape(b * h, n_k, -1).float()
    v3 = v.reshape(b * h, n_k, d_v).float()
    out = torch.empty(b * h, n_q, d_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(b * h, n_q, dtype=torch.float32, device=q.device)
    row = 0
    while row < n_q:
        q_tile = q3[:, row:row + block_q]
        rows = q_tile.shape[1]
        m = torch.full((b * h, rows), float("-inf"), device=q.device)
        l = torch.zeros(b * h, rows, device=q.device)
        acc = torch.zeros(b * h, rows, d_v, device=q.device)
        last_visible = row + rows - 1 + (n_k - n_q)
        col = 0
        while col < n_k and (not causal or col <= last_visible):
            s = torch.bmm(q_tile, k3[:, col:col + block_k].transpose(1, 2)) * scale
            if causal:
                i = torch.arange(row, row + rows, device=q.device)[:, None]
                j = torch.arange(col, col + s.shape[-1], device=q.device)[None, :]
                s = s.masked_fill(j > i + (n_k - n_q), torch.finfo(s.dtype).min)
            m, l, acc = online_softmax_step(m, l, acc, s, v3[:, col:col + block_k])
            col += block_k
        out[:, row:row + rows] = acc / l[..., None]
        lse[:, row:row + rows] = m + l.log()
        row += block_q
    if causal and n_q > n_k:  # queries that see no key: out 0, lse -inf, as SDPA and logsumexp
        out[:, :n_q - n_k] = 0.0
        lse[:, :n_q - n_k] = float("-inf")
    return out.reshape(b, h, n_q, d_v).to(q.dtype), lse.reshape(b, h, n_q)

# %% answer="flash_attention_kernel"
@triton.jit
def flash_attention_kernel(Q, K, V, Out, Lse,
                           stride_qh, stride_qs, stride_kh, stride_ks, stride_vh, stride_vs,
                           seq_q, seq_k, sm_scale,
                           CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                           HEAD_DIM: tl.constexpr):
    """Natural exp inside; m_i is converted to base 2 for the given epilogue."""
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
    end = seq_k
    if CAUSAL:
        end = tl.minimum(end, block_index * BLOCK_Q + BLOCK_Q + seq_k - seq_q)
    for start in range(0, end, BLOCK_K):
        keys = start + tl.arange(0, BLOCK_K)
        in_range = keys < seq_k
        k = tl.load(K + head_index * stride_kh + keys[:, None] * stride_ks + offs_d[None, :],
                    mask=in_range[:, None], other=0.0)
        v = tl.load(V + head_index * stride_vh + keys[:, None] * stride_vs + offs_d[None, :],
                    mask=in_range[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale  # natural units
        allowed = in_range[None, :]
        if CAUSAL:
            allowed = allowed & (keys[None, :] - offs_q[:, None] <= seq_k - seq_q)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        scale_old = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * scale_old + tl.sum(p, axis=1)
        acc = acc * scale_old[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    m_i = m_i * 1.4426950408889634  # the epilogue below expects base-2 units
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
    # float32 inside, einsum, queries outside (FlashAttention-1's order), dK/dV in lists of blocks.
    n_q, n_k = q.size(-2), k.size(-2)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    qf, kf, vf, of, dof = q.float(), k.float(), v.float(), out.float(), dout.float()
    lsef = lse.float().nan_to_num(neginf=0.0)  # a query that sees no key: P = exp(-1e9 - 0) = 0
    d_row = torch.einsum("bhqd,bhqd->bhq", dof, of)
    dk_blocks = [torch.zeros_like(kf[..., s:s + block_k, :]) for s in range(0, n_k, block_k)]
    dv_blocks = [torch.zeros_like(vf[..., s:s + block_k, :]) for s in range(0, n_k, block_k)]
    dq_blocks = []
    for qs in range(0, n_q, block_q):
        qe = min(n_q, qs + block_q)
        dq_blk = torch.zeros_like(qf[..., qs:qe, :])
        for index, ks in enumerate(range(0, n_k, block_k)):
            if causal and ks > qe - 1 + n_k - n_q:
                break
            ke = min(n_k, ks + block_k)
            s = torch.einsum("bhqd,bhkd->bhqk", qf[..., qs:qe, :], kf[..., ks:ke, :]) * scale
            if causal:
                hidden = torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None] + n_k - n_q
                s = s.masked_fill(hidden.to(s.device), -1e9)
            p = torch.exp(s - lsef[..., qs:qe, None])
            dv_blocks[index] += torch.einsum("bhqk,bhqd->bhkd", p, dof[..., qs:qe, :])
            dp = torch.einsum("bhqd,bhkd->bhqk", dof[..., qs:qe, :], vf[..., ks:ke, :])
            ds = p * (dp - d_row[..., qs:qe, None]) * scale
            dq_blk += torch.einsum("bhqk,bhkd->bhqd", ds, kf[..., ks:ke, :])
            dk_blocks[index] += torch.einsum("bhqk,bhqd->bhkd", ds, qf[..., qs:qe, :])
        dq_blocks.append(dq_blk)
    return (torch.cat(dq_blocks, -2).to(q.dtype), torch.cat(dk_blocks, -2).to(k.dtype),
            torch.cat(dv_blocks, -2).to(v.dtype))

# %% answer="FlashAttention"
class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        out, lse = flash_attention_forward(q, k, v, 32, 32, causal)
        ctx.causal = bool(causal)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = flash_attention_backward(q, k, v, out, lse, grad_out, 32, 32, ctx.causal)
        return (*grads, None)


def flash_attention(q, k, v, causal=False):
    return FlashAttention.apply(q, k, v, causal)

# %% answer="scale_kernel"
@triton.jit
def scale_kernel(X, Out, n, alpha, BLOCK: tl.constexpr):
    start = tl.program_id(axis=0) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    values = tl.load(X + idx, mask=idx < n)
    tl.store(Out + idx, values * alpha, mask=idx < n)

# %% answer="matmul_kernel"
@triton.jit
def matmul_kernel(A, B, C, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # the Triton tutorial's shape: pointers advanced each step, tl.dot with the accumulator
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < left) & (offs_n[None, :] < N), other=0.0)
        accumulator = tl.dot(a, b, accumulator)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, accumulator, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

# %% answer="row_softmax_kernel"
@triton.jit
def row_softmax_kernel(X, Out, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    # the Triton tutorial's fused softmax: other=-inf, max subtracted, tl.exp
    row_start = X + tl.program_id(0) * stride_x
    offsets = tl.arange(0, BLOCK)
    row = tl.load(row_start + offsets, mask=offsets < n_cols, other=-float("inf"))
    numerator = tl.exp(row - tl.max(row, axis=0))
    denominator = tl.sum(numerator, axis=0)
    tl.store(Out + tl.program_id(0) * stride_out + offsets, numerator / denominator, mask=offsets < n_cols)

# %% answer="online_softmax_kernel"
@triton.jit
def online_softmax_kernel(X, Out, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    # per-lane running statistics (one max and one sum per lane), folded into one at the end
    row_x = X + tl.program_id(0) * stride_x
    row_out = Out + tl.program_id(0) * stride_out
    offsets = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], -float("inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        block = tl.load(row_x + start + offsets, mask=start + offsets < n_cols, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, block)
        safe_max = tl.where(new_max == -float("inf"), 0.0, new_max)  # a lane that has seen only padding
        lane_sum = lane_sum * tl.exp(lane_max - safe_max) + tl.exp(block - safe_max)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    denominator = tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0)
    for start in range(0, n_cols, BLOCK):
        mask = start + offsets < n_cols
        block = tl.load(row_x + start + offsets, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(row_out + start + offsets, tl.exp(block - row_max) / denominator, mask=mask)

# %% answer="flash_attention_backward_kernel"
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
    for q_start in range(0, seq_q, BLOCK_Q):  # every query block; the mask zeroes what is not seen
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
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
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
    k_start = 0
    while k_start < k_stop:
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
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
        k_start += BLOCK_K
    dq = dq * sm_scale
    tl.store(DQ + rows, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])

# %% answer="ANSWER_BACKWARD_FLOPS"
ANSWER_BACKWARD_FLOPS = (2.5, 3.5)
