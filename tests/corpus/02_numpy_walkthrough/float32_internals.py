# Correct answers that compute in float32 inside and cast back (as mixed-precision code does),
# swapaxes/reshape with -1, -1e9 masks, an in-place softmax on a fresh array, one draw of both q
# and k, E[z²] - E[z]² for the variance; a forward and a backward in float32 with -1e9 masks and
# loops over the heads (s - lse taken in the inputs' precision).

# %% answer="row_times_matrix"
def row_times_matrix(x_row, W):
    n, m = W.shape
    out = np.empty(m, dtype=np.result_type(x_row, W))
    for j in range(m):
        out[j] = sum(x_row[i] * W[i, j] for i in range(n))
    return out

# %% answer="np_split_heads"
def np_split_heads(t, num_heads):
    if t.shape[-1] % num_heads != 0:
        raise ValueError(f"D = {t.shape[-1]} is not a multiple of num_heads = {num_heads}")
    return t.reshape(*t.shape[:-1], num_heads, -1).swapaxes(1, 2)

# %% answer="np_merge_heads"
def np_merge_heads(t):
    return t.swapaxes(1, 2).reshape(t.shape[0], t.shape[2], -1)

# %% answer="dot_product_variance"
def dot_product_variance(d_head, sigma, n_samples, rng):
    q, k = rng.normal(scale=sigma, size=(2, n_samples, d_head))
    z = (q * k).sum(axis=-1)
    return float(np.mean(z ** 2) - np.mean(z) ** 2)

# %% answer="np_softmax"
def np_softmax(x, axis=-1):
    out = x - np.max(x, axis=axis, keepdims=True)  # a new array: x itself stays untouched
    np.exp(out, out=out)  # in place from here on
    out /= out.sum(axis=axis, keepdims=True)
    return out

# %% answer="np_attention"
def np_attention(Q, K, V, mask=None):
    scale = 1.0 / math.sqrt(Q.shape[-1])
    scores = (Q @ np.swapaxes(K, -1, -2)) * scale
    if mask is not None:
        scores = np.where(mask, scores, -1e9)
    weights = np_softmax(scores.astype(np.float32), axis=-1).astype(Q.dtype)  # softmax in float32
    return weights @ V, weights

# %% answer="np_multi_head_attention"
def np_multi_head_attention(X, W_q, W_k, W_v, W_o, num_heads, mask=None):
    b, s, d = X.shape
    d_head = d // num_heads

    def heads(W):
        return (X @ W).reshape(b, s, num_heads, d_head).transpose(0, 2, 1, 3)

    scores = heads(W_q) @ heads(W_k).transpose(0, 1, 3, 2) / math.sqrt(d_head)
    if mask is not None:
        scores = np.where(mask, scores, -1e9)
    weights = np_softmax(scores.astype(np.float32)).astype(X.dtype)
    context = (weights @ heads(W_v)).transpose(0, 2, 1, 3).reshape(b, s, d)
    return context @ W_o

# %% answer="ANSWER_SCALING"
ANSWER_SCALING = " c "

# %% answer="softmax_backward"
def softmax_backward(p, dp, axis=-1):
    p32, dp32 = p.astype(np.float32), dp.astype(np.float32)  # mixed precision: float32 inside
    total = np.sum(p32 * dp32, axis=axis, keepdims=True)
    return (p32 * (dp32 - total)).astype(p.dtype)

# %% answer="np_attention_lse"
def np_attention_lse(Q, K, V, mask=None):
    B, H, S_q, d = Q.shape
    shape = (B, H, S_q, K.shape[2])
    allowed = np.ones(shape, dtype=bool) if mask is None else np.broadcast_to(mask, shape)
    out = np.zeros((B, H, S_q, V.shape[-1]), dtype=Q.dtype)
    lse = np.full((B, H, S_q), -np.inf, dtype=Q.dtype)
    for b in range(B):
        for h in range(H):
            scores = (Q[b, h].astype(np.float32) @ K[b, h].T.astype(np.float32)) / np.float32(math.sqrt(d))
            scores = np.where(allowed[b, h], scores, np.float32(-1e9))
            rows = allowed[b, h].any(axis=-1)  # the queries with at least one key
            top = scores.max(axis=-1, keepdims=True)
            exps = np.exp(scores - top)
            total = exps.sum(axis=-1, keepdims=True)
            out[b, h][rows] = ((exps / total) @ V[b, h].astype(np.float32))[rows]
            lse[b, h][rows] = (top + np.log(total))[rows, 0]
    return out, lse


# %% answer="np_attention_backward"
def np_attention_backward(Q, K, V, out, lse, dout, mask=None):
    B, H, S_q, d = Q.shape
    shape = (B, H, S_q, K.shape[2])
    allowed = np.ones(shape, dtype=bool) if mask is None else np.broadcast_to(mask, shape)
    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    for b in range(B):
        for h in range(H):
            rows = np.isfinite(lse[b, h])  # a query with no key sends nothing
            # s - lse in the inputs' precision (the two are close at large scores), the rest in float32
            scores = (Q[b, h] @ K[b, h].T) / math.sqrt(d)
            shift = np.where(rows, lse[b, h], 0.0)[:, None]
            exponent = np.where(allowed[b, h] & rows[:, None], scores - shift, -np.inf).astype(np.float32)
            weights = np.exp(exponent)
            delta = np.where(rows, np.sum(dout[b, h] * np.where(rows[:, None], out[b, h], 0.0), axis=-1), 0.0)
            d_weights = (dout[b, h] @ V[b, h].T).astype(np.float32)
            d_scores = weights * (d_weights - delta[:, None].astype(np.float32)) / np.float32(math.sqrt(d))
            dQ[b, h] = d_scores @ K[b, h]
            dK[b, h] = d_scores.T @ Q[b, h]
            dV[b, h] = weights.T @ dout[b, h]
    return dQ, dK, dV
