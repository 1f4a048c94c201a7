# Correct answers in the style of the Annotated Transformer and d2l: exp/log frequencies written
# into a zero table, a module-level `attention` helper the layer calls, float32 buffers, lower-case
# letters for the questions, zero_grad(set_to_none=True), no progress bar.

# %% answer="ANSWER_PERMUTATION"
ANSWER_PERMUTATION = "b"

# %% answer="sinusoidal_positions"
def sinusoidal_positions(num_positions, dim, base=10000.0):
    if dim % 2 == 1:
        raise ValueError("dim must be even, got dim=%d" % dim)
    pe = torch.zeros(num_positions, dim)
    position = torch.arange(0, num_positions).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, dim, 2) * -(math.log(base) / dim))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe

# %% answer="ANSWER_SHIFT"
ANSWER_SHIFT = " b "

# %% answer="pe_shift_matrix"
def pe_shift_matrix(offset, dim, base=10000.0):
    if dim % 2 == 1:
        raise ValueError("dim must be even, got dim=%d" % dim)
    div_term = torch.exp(torch.arange(0, dim, 2) * -(math.log(base) / dim))
    blocks = []
    for w in div_term:
        c, s = math.cos(offset * w.item()), math.sin(offset * w.item())
        blocks.append(torch.tensor([[c, s], [-s, c]]))
    return torch.block_diag(*blocks)

# %% answer="offset_only_qk"
def offset_only_qk(scales, angles):
    if len(scales) != len(angles):
        raise ValueError("got %d scales and %d angles" % (len(scales), len(angles)))
    m = torch.zeros(2 * len(scales), 2 * len(scales), dtype=scales.dtype, device=scales.device)
    for i in range(len(scales)):
        a, t = scales[i].item(), angles[i].item()
        m[2 * i, 2 * i], m[2 * i, 2 * i + 1] = a * math.cos(t), a * math.sin(t)
        m[2 * i + 1, 2 * i], m[2 * i + 1, 2 * i + 1] = -a * math.sin(t), a * math.cos(t)
    return m

# %% answer="FourierFeatures"
class FourierFeatures(nn.Module):
    def __init__(self, in_dim, num_frequencies):
        super().__init__()
        self.out_dim = 2 * in_dim * num_frequencies
        frequencies = math.pi * torch.pow(2.0, torch.arange(num_frequencies, dtype=torch.float32))
        self.register_buffer("freq_bands", frequencies, persistent=False)

    def forward(self, x):
        angles = torch.einsum("...c,f->...cf", x, self.freq_bands.to(x.dtype))
        angles = angles.reshape(*angles.shape[:-2], -1)
        return torch.cat((torch.sin(angles), torch.cos(angles)), dim=-1)

# %% answer="CoordinateMLP"
class CoordinateMLP(nn.Module):
    def __init__(self, encoder=None, hidden=256):
        super().__init__()
        self.encoder = encoder if encoder is not None else nn.Identity()
        d_in = 2 if encoder is None else encoder.out_dim
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden // 2)
        self.fc3 = nn.Linear(hidden // 2, hidden // 4)
        self.out = nn.Linear(hidden // 4, 3)

    def forward(self, coords):
        h = self.encoder(coords)
        h = F.relu(self.fc1(h))
        h = F.relu(self.fc2(h))
        h = F.relu(self.fc3(h))
        return self.out(h)

# %% answer="psnr"
def psnr(pred, target, max_value=1.0):
    with torch.no_grad():
        mse = F.mse_loss(pred.double(), target.double()).item()
    return float("inf") if mse == 0 else 20 * math.log10(max_value) - 10 * math.log10(mse)

# %% answer="fit_image"
def fit_image(model, coords, colors, steps, lr):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    history = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = ((model(coords) - colors) ** 2).mean()
        loss.backward()
        history.append(loss.item())
        optimizer.step()
    return history

# %% answer="TransformerLayer"
def attention(attn, x, mask=None):
    """Self-attention through nn.MultiheadAttention, with a mask in our convention (True = may attend)."""
    return attn(x, x, x, attn_mask=None if mask is None else ~mask, need_weights=False)[0]


class TransformerLayer(nn.Module):
    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(embed_dim, eps=1e-6)
        d_ff = int(mlp_ratio * embed_dim)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, d_ff), nn.GELU(), nn.Linear(d_ff, embed_dim))

    def forward(self, x, mask=None):
        x = x + attention(self.attn, self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))

# %% answer="Transformer"
import copy


def clones(module, n):
    """n independent deep copies (the Annotated Transformer's helper)."""
    return nn.ModuleList([copy.deepcopy(module) for _ in range(n)])


class Transformer(nn.Module):
    def __init__(self, embed_dim, num_heads, num_layers, mlp_ratio=4.0):
        super().__init__()
        self.layers = clones(TransformerLayer(embed_dim, num_heads, mlp_ratio), num_layers)
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)

    def forward(self, x, mask=None):
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)

# %% answer="ANSWER_NO_POSITIONS"
ANSWER_NO_POSITIONS = "c"

# %% answer="OrderTransformer"
class Embeddings(nn.Module):
    """The Annotated Transformer's lookup table, without its sqrt(d_model) factor (the contract adds the
    embedding unscaled)."""

    def __init__(self, d_model, vocab):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)

    def forward(self, x):
        return self.lut(x)


class PositionalEncoding(nn.Module):
    """Adds a [1, max_len, d_model] buffer; dropout 0 so the output is deterministic."""

    def __init__(self, d_model, max_len):
        super().__init__()
        self.register_buffer("pe", sinusoidal_positions(max_len, d_model).unsqueeze(0), persistent=False)

    def forward(self, x):
        return x + self.pe[:, : x.size(1)].requires_grad_(False)


class LearnedPositions(nn.Module):
    def __init__(self, d_model, max_len):
        super().__init__()
        self.pe = nn.Parameter(torch.randn(1, max_len, d_model) * 0.02)

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class OrderTransformer(nn.Module):
    def __init__(self, vocab_size, embed_dim, num_heads, num_layers, max_len, positions="sinusoidal"):
        super().__init__()
        encodings = {"sinusoidal": lambda: PositionalEncoding(embed_dim, max_len),
                     "learned": lambda: LearnedPositions(embed_dim, max_len),
                     "none": nn.Identity}
        if positions not in encodings:
            raise ValueError("positions must be sinusoidal, learned or none, got %s" % positions)
        self.src_embed = nn.Sequential(Embeddings(embed_dim, vocab_size), encodings[positions]())
        self.encoder = Transformer(embed_dim, num_heads, num_layers)
        self.generator = nn.Linear(embed_dim, vocab_size)

    def forward(self, tokens, mask=None):
        return self.generator(self.encoder(self.src_embed(tokens), mask))

# %% answer="ANSWER_NOPE_CAUSAL"
ANSWER_NOPE_CAUSAL = "c"

# %% answer="previous_token_score"
def previous_token_score(attention):
    "Loop over the layers of a list (or of a stacked tensor), as d2l's visualisations do."
    layers = list(attention) if isinstance(attention, (list, tuple)) else None
    if layers is None:
        if attention.dim() != 5:
            raise ValueError("expected a [B, layers, heads, S, S] tensor, got rank %d" % attention.dim())
        layers = [attention[:, l] for l in range(attention.shape[1])]
    scores = []
    for p_attn in layers:  # [B, heads, S, S]
        n_q, n_k = p_attn.shape[-2:]
        if n_q != n_k:
            raise ValueError("attention maps must be square, got %d x %d" % (n_q, n_k))
        if n_q == 1:
            raise ValueError("S = 1: nothing comes before the only token")
        total = torch.zeros(p_attn.shape[1], dtype=p_attn.dtype, device=p_attn.device)
        for i in range(1, n_q):
            total = total + p_attn[:, :, i, i - 1].mean(dim=0)
        scores.append(total / (n_q - 1))
    return torch.stack(scores)

# %% answer="induction_score"
def induction_score(attention, tokens):
    "Loops over sequences and queries, a list of keys per query, as a first draft would."
    p_attn = torch.stack(list(attention), 1) if isinstance(attention, (list, tuple)) else attention
    if p_attn.dim() != 5 or p_attn.shape[-1] != p_attn.shape[-2]:
        raise ValueError("expected square maps [B, layers, heads, S, S], got %s" % (tuple(p_attn.shape),))
    if tuple(tokens.shape) != (p_attn.shape[0], p_attn.shape[-1]):
        raise ValueError("tokens %s do not match the maps %s" % (tuple(tokens.shape), tuple(p_attn.shape)))
    total = torch.zeros(p_attn.shape[1:3], dtype=p_attn.dtype, device=p_attn.device)
    pairs = 0
    rows = tokens.tolist()
    for b, row in enumerate(rows):
        for i in range(len(row)):
            keys = [j + 1 for j in range(i - 1) if row[j] == row[i]]
            if keys:
                total = total + p_attn[b, :, :, i, keys].sum(dim=-1)
                pairs += 1
    return total / pairs if pairs else total

# %% answer="induction_model"
def induction_model(vocab_size, max_len):
    "The notebook's model in another layout ([position | token | previous | copied]); key 0 kept off layer 2 by a key "
    "that also subtracts its own token (at position 0 'previous' is the token itself: they cancel)."
    V, L, c = vocab_size, max_len, 25.0
    position, token = slice(0, L), slice(L, L + V)
    previous, copied = slice(L + V, L + 2 * V), slice(L + 2 * V, L + 3 * V)
    model = AttentionOnlyModel(V, L, L + 3 * V)
    one_back = torch.zeros(L, L)
    for p in range(1, L):
        one_back[p, p - 1] = c
    with torch.no_grad():
        model.token_embedding[:, token] = torch.eye(V)
        model.position_embedding[:, position] = torch.eye(L)
        layer_1, layer_2 = model.layers
        layer_1.W_q[position, position] = one_back
        layer_1.W_k[position, position] = torch.eye(L)
        layer_1.W_v[token, previous] = torch.eye(V)   # a head may write straight into the slice it fills
        layer_1.W_o[previous, previous] = torch.eye(V)
        layer_2.W_q[token, token] = c * torch.eye(V)
        layer_2.W_k[previous, token] = torch.eye(V)
        layer_2.W_k[token, token] = -torch.eye(V)
        layer_2.W_v[token, copied] = torch.eye(V)
        layer_2.W_o[copied, copied] = torch.eye(V)
        model.unembedding[copied, :] = torch.eye(V)
    return model
