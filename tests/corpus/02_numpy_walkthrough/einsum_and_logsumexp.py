# Correct answers with einsum-free loops for the row, moveaxis for heads, a log-sum-exp softmax,
# -inf masks, keyword calls of the earlier answers, and a variance from a list of dot products; a
# forward whose lse is np.logaddexp.reduce, and a backward that nan_to_num's the saved out for D.

# %% answer="row_times_matrix"
def row_times_matrix(x_row, W):
    columns = [sum(x_row[i] * W[i, j] for i in range(W.shape[0])) for j in range(W.shape[1])]
    return np.array(columns, dtype=np.result_type(x_row, W))

# %% answer="np_split_heads"
def np_split_heads(t, num_heads):
    B, S, D = t.shape
    if D % num_heads:
        raise ValueError(f"{D} features do not split into {num_heads} heads")
    return np.moveaxis(t.reshape(B, S, num_heads, D // num_heads), 2, 1)

# %% answer="np_merge_heads"
def np_merge_heads(t):
    B, H, S, d = t.shape
    return np.moveaxis(t, 1, 2).reshape(B, S, H * d)

# %% answer="dot_product_variance"
def dot_product_variance(d_head, sigma, n_samples, rng):
    queries = rng.normal(loc=0.0, scale=sigma, size=(n_samples, d_head))
    keys = rng.normal(loc=0.0, scale=sigma, size=(n_samples, d_head))
    dots = np.array([q @ k for q, k in zip(queries, keys)])
    return float(np.var(dots))

# %% answer="np_softmax"
def np_softmax(x, axis=-1):
    top = np.max(x, axis=axis, keepdims=True)
    log_total = top + np.log(np.sum(np.exp(x - top), axis=axis, keepdims=True))
    return np.exp(x - log_total)

# %% answer="np_attention"
def np_attention(Q, K, V, mask=None):
    scores = np.einsum("...qd,...kd->...qk", Q, K) / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    weights = np_softmax(scores, axis=-1)
    return np.einsum("...qk,...kd->...qd", weights, V), weights

# %% answer="np_multi_head_attention"
def np_multi_head_attention(X, W_q, W_k, W_v, W_o, num_heads, mask=None):
    Q, K, V = (np_split_heads(t=X @ W, num_heads=num_heads) for W in (W_q, W_k, W_v))
    context, _weights = np_attention(Q=Q, K=K, V=V, mask=mask)
    return np_merge_heads(t=context) @ W_o

# %% answer="ANSWER_SCALING"
ANSWER_SCALING = "c"

# %% answer="softmax_backward"
def softmax_backward(p, dp, axis=-1):
    p_last, dp_last = np.moveaxis(p, axis, -1), np.moveaxis(dp, axis, -1)
    row_dot = np.einsum("...i,...i->...", p_last, dp_last)[..., None]
    return np.moveaxis(p_last * (dp_last - row_dot), -1, axis)

# %% answer="np_attention_lse"
@np.errstate(invalid="raise", divide="raise")  # fail loudly if an invalid operation ever slips in
def np_attention_lse(Q, K, V, mask=None):
    scores = np.einsum("...qd,...kd->...qk", Q, K) / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    lse = np.logaddexp.reduce(scores, axis=-1)  # stable; -inf for a row of -inf, and no warning
    has_key = np.isfinite(lse)
    weights = np.exp(scores - np.where(has_key, lse, 0.0)[..., None])  # 0 on a row with no key
    return np.einsum("...qk,...kv->...qv", weights, V), lse


# %% answer="np_attention_backward"
def np_attention_backward(Q, K, V, out, lse, dout, mask=None):
    scores = np.einsum("...qd,...kd->...qk", Q, K) / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    has_key = np.isfinite(lse)[..., None]
    weights = np.exp(scores - np.where(has_key, lse[..., None], 0.0))  # P from lse, no softmax
    delta = np.einsum("...qv,...qv->...q", dout, np.nan_to_num(out))[..., None]  # rowsum(dO ∘ O)
    d_weights = np.einsum("...qv,...kv->...qk", dout, V)
    d_scores = weights * (d_weights - delta) / math.sqrt(Q.shape[-1])
    return (np.einsum("...qk,...kd->...qd", d_scores, K).astype(Q.dtype),
            np.einsum("...qk,...qd->...kd", d_scores, Q).astype(Q.dtype),
            np.einsum("...qk,...qv->...kv", weights, dout).astype(Q.dtype))
