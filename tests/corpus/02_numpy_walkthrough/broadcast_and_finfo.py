# Correct answers in another style: one loop with an elementwise sum, split/concatenate for heads,
# np.finfo(dtype).min masks, a helper named `softmax`, einsum projections, `* d ** -0.5`; a backward
# with the expanded softmax formula and FlashAttention's rowsum(dout * out).

# %% answer="row_times_matrix"
def row_times_matrix(x_row, W):
    columns = []
    for j in range(W.shape[1]):  # one loop, over the outputs; the sum over i is elementwise
        columns.append(np.sum(x_row * W[:, j]))
    return np.array(columns, dtype=np.result_type(x_row, W))

# %% answer="np_split_heads"
def np_split_heads(t, num_heads):
    if t.shape[-1] % num_heads:
        raise ValueError(f"cannot split D={t.shape[-1]} into num_heads={num_heads} equal heads")
    return np.stack(np.split(t, num_heads, axis=-1), axis=1)

# %% answer="np_merge_heads"
def np_merge_heads(t):
    return np.concatenate([t[:, h] for h in range(t.shape[1])], axis=-1)

# %% answer="dot_product_variance"
def dot_product_variance(d_head, sigma, n_samples, rng):
    q = rng.normal(0.0, sigma, (n_samples, d_head))
    k = rng.normal(0.0, sigma, (n_samples, d_head))
    return float(np.einsum("nd,nd->n", q, k).var())

# %% answer="np_softmax"
def np_softmax(x, axis=-1):
    z = np.exp(x - x.max(axis=axis, keepdims=True))
    return z / z.sum(axis=axis, keepdims=True)

# %% answer="np_attention"
def softmax(x, axis=-1):
    z = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return z / np.sum(z, axis=axis, keepdims=True)


def np_attention(Q, K, V, mask=None):
    scores = np.einsum("bhqd,bhkd->bhqk", Q, K) * Q.shape[-1] ** -0.5
    if mask is not None:
        scores = np.where(mask, scores, np.finfo(scores.dtype).min)
    weights = softmax(scores)
    return np.einsum("bhqk,bhkd->bhqd", weights, V), weights

# %% answer="np_multi_head_attention"
def np_multi_head_attention(X, W_q, W_k, W_v, W_o, num_heads, mask=None):
    project = lambda W: np_split_heads(np.einsum("bsd,de->bse", X, W), num_heads)
    context, _ = np_attention(project(W_q), project(W_k), project(W_v), mask)
    return np.einsum("bsd,de->bse", np_merge_heads(context), W_o)

# %% answer="ANSWER_SCALING"
ANSWER_SCALING = "C"

# %% answer="softmax_backward"
def softmax_backward(p, dp, axis=-1):
    weighted = p * dp
    return weighted - p * weighted.sum(axis=axis, keepdims=True)

# %% answer="np_attention_lse"
def np_attention_lse(Q, K, V, mask=None):
    scores = np.einsum("bhqd,bhkd->bhqk", Q, K) * Q.shape[-1] ** -0.5
    if mask is not None:
        scores = np.where(mask, scores, np.finfo(scores.dtype).min)
    top = scores.max(axis=-1, keepdims=True)  # finite: the fill is the dtype's minimum
    weights = np.exp(scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    lse = (top + np.log(total))[..., 0]
    out = np.einsum("bhqk,bhkd->bhqd", weights / total, V)
    if mask is not None:  # a query with no key: all scores at the fill, so uniform; PyTorch says 0, -inf
        no_key = ~np.any(np.broadcast_to(mask, scores.shape), axis=-1)
        out = np.where(no_key[..., None], 0.0, out)
        lse = np.where(no_key, -np.inf, lse)
    return out.astype(Q.dtype), lse.astype(Q.dtype)


# %% answer="np_attention_backward"
def np_attention_backward(Q, K, V, out, lse, dout, mask=None):
    scale = Q.shape[-1] ** -0.5
    scores = np.einsum("bhqd,bhkd->bhqk", Q, K) * scale
    if mask is not None:
        scores = np.where(mask, scores, np.finfo(scores.dtype).min)
    seen = np.isfinite(lse)[..., None]  # False: a query with no key
    weights = np.where(seen, np.exp(scores - np.where(seen, lse[..., None], 0.0)), 0.0)
    if mask is not None:
        weights = weights * mask  # the fill gives exp(min - lse) = 0 already; be exact
    d_weights = np.einsum("bhqd,bhkd->bhqk", dout, V)
    row = np.einsum("bhqd,bhqd->bhq", dout, np.where(seen, out, 0.0))[..., None]  # FlashAttention's D
    d_scores = weights * (d_weights - row) * scale
    dQ = np.einsum("bhqk,bhkd->bhqd", d_scores, K)
    dK = np.einsum("bhqk,bhqd->bhkd", d_scores, Q)
    dV = np.einsum("bhqk,bhqd->bhkd", weights, dout)
    return dQ.astype(Q.dtype), dK.astype(Q.dtype), dV.astype(Q.dtype)
