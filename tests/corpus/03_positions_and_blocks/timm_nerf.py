# Correct answers in the style of timm and NeRF code: a float32 buffer of 2^k with pi applied in
# forward, keyword calls (layer(x=x, mask=mask)), an additive float mask with the dtype's finite
# minimum, a fused helper named `block`, psnr as -10·log10(MSE), a tqdm bar with its own options.

# %% answer="ANSWER_PERMUTATION"
ANSWER_PERMUTATION = "B"  # equivariant: shuffled in, shuffled out

# %% answer="sinusoidal_positions"
def sinusoidal_positions(num_positions, dim, base=10000.0):
    if dim % 2:
        raise ValueError(f"sinusoidal_positions needs an even dim, got {dim}")
    omega = 1.0 / base ** (torch.arange(dim // 2, dtype=torch.float32) * 2 / dim)   # [D/2]
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * omega[None]  # [P, D/2]
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1)               # interleaved

# %% answer="ANSWER_SHIFT"
ANSWER_SHIFT = "B"  # a rotation per pair

# %% answer="pe_shift_matrix"
def pe_shift_matrix(offset, dim, base=10000.0):
    """Each 2x2 block is the sinusoidal pair of the offset itself: rows (cos, sin) and (-sin, cos)."""
    if dim % 2:
        raise ValueError(f"dim={dim}: must be even")
    omega = 1.0 / base ** (torch.arange(dim // 2, dtype=torch.float64) * 2 / dim)
    cos, sin = torch.cos(offset * omega), torch.sin(offset * omega)
    blocks = torch.stack([torch.stack([cos, sin], -1), torch.stack([-sin, cos], -1)], -2)   # [D/2, 2, 2]
    return torch.block_diag(*blocks.float())

# %% answer="offset_only_qk"
def offset_only_qk(scales, angles):
    """Scaled pe_shift_matrix blocks: a·cos on the diagonal, ±a·sin next to it, with torch.block_diag."""
    if scales.shape != angles.shape:
        raise ValueError(f"scales{tuple(scales.shape)} vs angles{tuple(angles.shape)}")
    cos, sin = scales * angles.cos(), scales * angles.sin()
    blocks = torch.stack([torch.stack([cos, sin], -1), torch.stack([-sin, cos], -1)], -2)   # [D/2, 2, 2]
    return torch.block_diag(*blocks)

# %% answer="FourierFeatures"
class FourierFeatures(nn.Module):
    """NeRF-style: the buffer holds 2^k; pi is applied in forward."""

    def __init__(self, in_dim, num_frequencies):
        super().__init__()
        self.in_dim, self.num_frequencies = in_dim, num_frequencies
        self.out_dim = in_dim * num_frequencies * 2
        self.register_buffer("scales", 2.0 ** torch.linspace(0, num_frequencies - 1, num_frequencies),
                             persistent=False)

    def forward(self, x):
        scaled = (x.unsqueeze(-1) * self.scales).flatten(start_dim=-2)   # [..., in_dim * F]
        angles = torch.pi * scaled
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)

# %% answer="CoordinateMLP"
class CoordinateMLP(nn.Module):
    def __init__(self, encoder=None, hidden=256):
        super().__init__()
        self.encoder = encoder
        widths = [2 if encoder is None else encoder.out_dim, hidden, hidden // 2, hidden // 4]
        layers = []
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU(inplace=True)]
        layers.append(nn.Linear(widths[-1], 3))
        self.net = nn.Sequential(*layers)

    def forward(self, coords):
        if self.encoder is not None:
            coords = self.encoder(coords)
        return self.net(coords)

# %% answer="psnr"
def psnr(pred, target, max_value=1.0):
    mse = torch.mean((pred.detach().float() - target.detach().float()) ** 2)
    if mse == 0:
        return math.inf
    return float(-10.0 * torch.log10(mse / max_value ** 2))

# %% answer="fit_image"
from tqdm.auto import trange


def fit_image(model, coords, colors, steps, lr, progress=True):
    optimizer = torch.optim.Adam(params=model.parameters(), lr=lr)
    losses = []
    with trange(steps, disable=not progress, leave=False) as bar:
        for _ in bar:
            prediction = model(coords)
            loss = F.mse_loss(prediction, colors, reduction="mean")
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach().item())
    return losses

# %% answer="TransformerLayer"
class TransformerLayer(nn.Module):
    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        mlp_hidden_dim = int(embed_dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True, batch_first=True)
        self.norm2 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, mlp_hidden_dim),
            nn.GELU(),
            nn.Linear(mlp_hidden_dim, embed_dim),
        )

    def forward(self, x, mask=None):
        attn_mask = None
        if mask is not None:  # additive: 0 where allowed, the dtype's finite minimum where blocked
            attn_mask = torch.zeros(mask.shape, dtype=x.dtype, device=x.device)
            attn_mask = attn_mask.masked_fill(mask.logical_not(), torch.finfo(x.dtype).min)
        h = self.norm1(x)
        x = x + self.attn(query=h, key=h, value=h, attn_mask=attn_mask, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return x

# %% answer="Transformer"
def block(layer, x, mask):
    """One layer, called by keyword (timm style)."""
    return layer(x=x, mask=mask)


class Transformer(nn.Module):
    def __init__(self, embed_dim, num_heads, num_layers, mlp_ratio=4.0):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(num_layers):
            self.layers.append(TransformerLayer(embed_dim, num_heads, mlp_ratio=mlp_ratio))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)

    def forward(self, x, mask=None):
        for layer in self.layers:
            x = block(layer, x, mask)
        return self.norm(x)

# %% answer="ANSWER_NO_POSITIONS"
ANSWER_NO_POSITIONS = "C"  # 1/(S-1)

# %% answer="OrderTransformer"
class OrderTransformer(nn.Module):
    """timm / MAE style: pos_embed a Parameter [1, max_len, D] in every mode, frozen (requires_grad=False)
    and filled with the sin-cos table when fixed, truncated-normal when learned, zeros (unused) for none."""

    def __init__(self, vocab_size, embed_dim, num_heads, num_layers, max_len, positions="sinusoidal"):
        super().__init__()
        if positions not in ("sinusoidal", "learned", "none"):
            raise ValueError(f"positions={positions!r} is not one of 'sinusoidal', 'learned', 'none'")
        self.use_pos = positions != "none"
        self.tok_embed = nn.Embedding(vocab_size, embed_dim)
        if positions == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, max_len, embed_dim))
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        elif positions == "sinusoidal":
            self.pos_embed = nn.Parameter(sinusoidal_positions(max_len, embed_dim)[None], requires_grad=False)
        self.blocks = Transformer(embed_dim, num_heads, num_layers)
        self.head = nn.Linear(embed_dim, vocab_size)

    def forward(self, tokens, mask=None):
        x = self.tok_embed(tokens)
        if self.use_pos:
            x = x + self.pos_embed[:, : tokens.shape[1], :]
        return self.head(self.blocks(x=x, mask=mask))

# %% answer="ANSWER_NOPE_CAUSAL"
ANSWER_NOPE_CAUSAL = " C "  # recency: the most recent visible token

# %% answer="previous_token_score"
def previous_token_score(attention):
    attn = torch.stack(tuple(attention), dim=1) if isinstance(attention, list) else attention
    if attn.ndim != 5 or attn.shape[-1] != attn.shape[-2] or attn.shape[-1] < 2:
        raise ValueError(f"want [B, layers, heads, S, S] with S >= 2 and square maps, got {tuple(attn.shape)}")
    # the identity rolled one column left: row i has its 1 at column i - 1 (row 0 wraps round, dropped below)
    shifted = torch.roll(torch.eye(attn.shape[-1], dtype=attn.dtype, device=attn.device), -1, dims=-1)
    weight = (attn * shifted).sum(dim=-1)[..., 1:]  # [B, layers, heads, S-1]
    return weight.mean(dim=(0, -1))

# %% answer="induction_score"
def induction_score(attention, tokens):
    """One einsum over a one-hot of the induction keys; keyword-friendly, float math in the maps' dtype."""
    attn = torch.stack([a for a in attention], dim=1) if isinstance(attention, (list, tuple)) else attention
    if attn.dim() != 5 or attn.size(-1) != attn.size(-2) or tokens.shape != attn.shape[:1] + attn.shape[-1:]:
        raise ValueError(f"induction_score: maps {tuple(attn.shape)} vs tokens {tuple(tokens.shape)}")
    n = tokens.size(1)
    idx = torch.arange(n, device=tokens.device)
    match = (tokens.unsqueeze(-1) == tokens.unsqueeze(-2)) & (idx.view(1, 1, n) < idx.view(1, n, 1) - 1)  # [b, i, j]
    keys = torch.nn.functional.pad(match, (1, 0))[..., :n]                                          # j -> j + 1
    valid = match.any(dim=-1)
    num = torch.einsum("blhik,bik,bi->lh", attn, keys.to(attn.dtype), valid.to(attn.dtype))
    return num / valid.sum().clamp_min(1).to(attn.dtype)

# %% answer="induction_model"
class InductionPair(nn.Module):
    """A model of its own (not the notebook's class): bias-free nn.Linear projections, a 1/sqrt(d) scale with
    the strength folded in, the stream as a dict of named slices."""

    def __init__(self, vocab_size, max_len, strength=20.0):
        super().__init__()
        V, L = vocab_size, max_len
        self.V, self.L = V, L
        self.dim = dim = 3 * V + L
        self.tok = nn.Embedding(V, dim)
        self.pos = nn.Embedding(L, dim)
        self.qkvo = nn.ModuleList([nn.ModuleList([nn.Linear(dim, dim, bias=False) for _ in range(4)])
                                   for _ in range(2)])
        self.head = nn.Linear(dim, V, bias=False)
        scale = strength * math.sqrt(dim)  # cancels the 1/sqrt(dim) of forward
        s = {"tok": slice(0, V), "pos": slice(V, V + L), "prev": slice(V + L, 2 * V + L), "copy": slice(2 * V + L, dim)}
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()
            self.tok.weight[:, s["tok"]] = torch.eye(V)
            self.pos.weight[:, s["pos"]] = torch.eye(L)
            (q1, k1, v1, o1), (q2, k2, v2, o2) = self.qkvo
            # nn.Linear computes x @ weight.T: weights are [out, in]
            q1.weight[s["pos"], s["pos"]] = scale * torch.diag(torch.ones(L - 1), 1)   # in p -> out p - 1
            k1.weight[s["pos"], s["pos"]] = torch.eye(L)
            v1.weight[s["prev"], s["tok"]] = torch.eye(V)
            o1.weight[s["prev"], s["prev"]] = torch.eye(V)
            q2.weight[s["tok"], s["tok"]] = scale * torch.eye(V)
            k2.weight[s["tok"], s["prev"]] = torch.eye(V)
            q2.weight[V, s["pos"]] = scale / strength      # every query: a constant in coordinate V
            k2.weight[V, V] = -strength                    # key 0 (its position one-hot is coordinate V)
            v2.weight[s["copy"], s["tok"]] = torch.eye(V)
            o2.weight[s["copy"], s["copy"]] = torch.eye(V)
            self.head.weight[:, s["copy"]] = torch.eye(V)

    def _run(self, tokens):
        S = tokens.size(1)
        x = self.tok(tokens) + self.pos(torch.arange(S, device=tokens.device))
        future = torch.triu(torch.ones(S, S, dtype=torch.bool, device=tokens.device), diagonal=1)
        maps = []
        for q, k, v, o in self.qkvo:
            logits = q(x) @ k(x).transpose(-1, -2) / math.sqrt(self.dim)
            attn = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
            x = x + o(attn @ v(x))
            maps.append(attn.unsqueeze(1))
        return self.head(x), maps

    def forward(self, tokens):
        return self._run(tokens)[0]

    def attention(self, tokens):
        return self._run(tokens)[1]


def induction_model(vocab_size, max_len):
    return InductionPair(vocab_size, max_len)
