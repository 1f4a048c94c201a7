# Correct answers written with einops and NumPy: rearrange to interleave the sin/cos table
# (computed in float64, returned in the default dtype) and to flatten the angles, psnr in NumPy,
# losses kept as tensors and converted at the end, grads cleared by hand, a -1e9 additive mask,
# a stack of deep copies of one layer (as nn.TransformerEncoder builds it).

# %% answer="ANSWER_PERMUTATION"
ANSWER_PERMUTATION = "B"

# %% answer="sinusoidal_positions"
from einops import rearrange


def sinusoidal_positions(num_positions, dim, base=10000.0):
    if dim % 2 != 0:
        raise ValueError(f"odd dim: {dim}")
    i = torch.arange(dim // 2, dtype=torch.float64)
    p = torch.arange(num_positions, dtype=torch.float64)
    angles = torch.outer(p, base ** (-2.0 * i / dim))                       # [P, D/2] in float64
    table = rearrange([angles.sin(), angles.cos()], "two p half -> p (half two)")
    return table.float()                                                     # the default dtype

# %% answer="ANSWER_SHIFT"
ANSWER_SHIFT = "B"

# %% answer="pe_shift_matrix"
import numpy as np


def pe_shift_matrix(offset, dim, base=10000.0):
    """Built in NumPy (float64), returned in the default dtype; one np.ix_ write per pair."""
    if dim % 2:
        raise ValueError(f"pe_shift_matrix needs an even dim, got {dim}")
    matrix = np.zeros((dim, dim))
    for i, w in enumerate(np.power(base, -np.arange(0, dim, 2) / dim)):
        angle = offset * w
        matrix[np.ix_([2 * i, 2 * i + 1], [2 * i, 2 * i + 1])] = [[np.cos(angle), np.sin(angle)],
                                                                  [-np.sin(angle), np.cos(angle)]]
    return torch.from_numpy(matrix).to(torch.get_default_dtype())

# %% answer="offset_only_qk"
def offset_only_qk(scales, angles):
    """NumPy blocks a·[[cos, sin], [-sin, cos]], laid on the diagonal with np.kron of a one-hot per pair."""
    a, t = scales.detach().cpu().numpy(), angles.detach().cpu().numpy()
    if a.shape != t.shape:
        raise ValueError(f"scales {a.shape} and angles {t.shape} differ")
    matrix = sum(np.kron(np.eye(len(a))[i][:, None] * np.eye(len(a))[i][None, :],
                         a[i] * np.array([[np.cos(t[i]), np.sin(t[i])], [-np.sin(t[i]), np.cos(t[i])]]))
                 for i in range(len(a)))
    return torch.as_tensor(matrix).to(scales)

# %% answer="FourierFeatures"
from einops import rearrange


class FourierFeatures(nn.Module):
    def __init__(self, in_dim, num_frequencies):
        super().__init__()
        self.out_dim = in_dim * 2 * num_frequencies
        self.register_buffer("frequencies", torch.tensor([math.pi * 2 ** k for k in range(num_frequencies)]),
                             persistent=False)

    def forward(self, x):
        angles = rearrange(x[..., :, None] * self.frequencies.type_as(x), "... c f -> ... (c f)")
        return torch.cat([angles.sin(), angles.cos()], -1)

# %% answer="CoordinateMLP"
class CoordinateMLP(nn.Module):
    def __init__(self, encoder=None, hidden=256):
        super().__init__()
        self.encoder = encoder
        in_features = getattr(encoder, "out_dim", 2)
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden // 2), nn.ReLU(),
            nn.Linear(hidden // 2, hidden // 4), nn.ReLU(),
            nn.Linear(hidden // 4, 3),
        )

    def forward(self, coords):
        return self.net(coords if self.encoder is None else self.encoder(coords))

# %% answer="psnr"
import numpy as np


def psnr(pred, target, max_value=1.0):
    error = pred.detach().cpu().double().numpy() - target.detach().cpu().double().numpy()
    mse = np.mean(np.square(error))
    with np.errstate(divide="ignore"):
        return float(10.0 * np.log10(max_value ** 2 / mse)) if mse > 0 else float("inf")

# %% answer="fit_image"
from tqdm.auto import tqdm


def fit_image(model, coords, colors, steps, lr, progress=True):
    optimizer = torch.optim.Adam(model.parameters(), lr)
    criterion = nn.MSELoss()
    recorded = []
    for _ in tqdm(range(steps), disable=not progress):
        for parameter in model.parameters():
            parameter.grad = None
        loss = criterion(model(coords), colors)
        loss.backward()
        optimizer.step()
        recorded.append(loss.detach())
    return [value.item() for value in recorded]

# %% answer="TransformerLayer"
class TransformerLayer(nn.Module):
    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        hidden = int(mlp_ratio * embed_dim)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, hidden), nn.GELU(approximate="none"),
                                 nn.Linear(hidden, embed_dim))
        self.norm1, self.norm2 = nn.LayerNorm(embed_dim, eps=1e-6), nn.LayerNorm(embed_dim, eps=1e-6)

    def forward(self, x, mask=None):
        y = self.norm1(x)
        # A -1e9 additive mask (a common idiom) works as well as the boolean one.
        bias = None if mask is None else (~mask).to(x.dtype) * -1e9
        attended, _ = self.attn(y, y, y, attn_mask=bias, need_weights=False)
        x = torch.add(x, attended)
        return x + self.mlp(self.norm2(x))

# %% answer="Transformer"
import copy


class Transformer(nn.Module):
    def __init__(self, embed_dim, num_heads, num_layers, mlp_ratio=4.0):
        super().__init__()
        layer = TransformerLayer(embed_dim, num_heads, mlp_ratio)
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)

    def forward(self, x, mask=None):
        out = x
        for index in range(len(self.layers)):
            out = self.layers[index](out, mask=mask)
        return self.norm(out)

# %% answer="ANSWER_NO_POSITIONS"
ANSWER_NO_POSITIONS = "C"

# %% answer="OrderTransformer"
from einops import rearrange


class OrderTransformer(nn.Module):
    """Positions kept as [1, max_len, D] (a batch axis first, made with rearrange), learned ones initialised
    in place with nn.init.normal_, attributes named embed / pos / blocks / out."""

    def __init__(self, vocab_size, embed_dim, num_heads, num_layers, max_len, positions="sinusoidal"):
        super().__init__()
        self.mode = positions
        self.embed = nn.Embedding(vocab_size, embed_dim)
        if positions == "learned":
            self.pos = nn.Parameter(rearrange(torch.zeros(max_len, embed_dim), "s d -> 1 s d"))
            nn.init.normal_(self.pos, std=0.02)
        elif positions == "sinusoidal":
            self.register_buffer("pos", rearrange(sinusoidal_positions(max_len, embed_dim), "s d -> 1 s d"),
                                 persistent=False)
        elif positions == "none":
            self.pos = None
        else:
            raise ValueError(f"unknown positions: {positions}")
        self.blocks = Transformer(embed_dim, num_heads, num_layers)
        self.out = nn.Linear(embed_dim, vocab_size)

    def forward(self, tokens, mask=None):
        b, s = tokens.shape
        h = self.embed(tokens)                                   # [b, s, d]
        if self.pos is not None:
            h = h + self.pos[:, :s]
        return self.out(self.blocks(h, mask))

# %% answer="ANSWER_NOPE_CAUSAL"
ANSWER_NOPE_CAUSAL = "C"

# %% answer="previous_token_score"
def previous_token_score(attention):
    from einops import reduce

    if isinstance(attention, (list, tuple)):
        attention = rearrange(list(attention), "l b h q k -> b l h q k")
    if attention.ndim != 5:
        raise ValueError(f"rank {attention.ndim}: need b l h q k")
    b, l, h, q, k = attention.shape
    if q != k or q < 2:
        raise ValueError(f"need square maps with S >= 2, got {q} x {k}")
    previous = torch.zeros(q, k, dtype=torch.bool, device=attention.device)
    previous[torch.arange(1, q), torch.arange(q - 1)] = True  # one True per query 1 ... S-1
    picked = attention[..., previous]  # [b, l, h, S-1]
    return reduce(picked, "b l h i -> l h", "mean")

# %% answer="induction_score"
import numpy as np
from einops import reduce


def induction_score(attention, tokens):
    """The key mask built in NumPy (a shifted equality, lower-triangular), the sum with einops; the result back in
    the maps' dtype and device."""
    attn = torch.stack(list(attention), dim=1) if isinstance(attention, (list, tuple)) else attention
    if attn.ndim != 5 or attn.shape[-1] != attn.shape[-2] or tuple(tokens.shape) != (attn.shape[0], attn.shape[-1]):
        raise ValueError(f"attention {tuple(attn.shape)} and tokens {tuple(tokens.shape)} do not fit together")
    t = tokens.cpu().numpy()
    s = t.shape[1]
    before = np.concatenate([np.full_like(t[:, :1], -1), t[:, :-1]], axis=1)           # the token before key k
    keys = (before[:, None, :] == t[:, :, None]) & np.tril(np.ones((s, s), dtype=bool), -1)[None]
    counted = keys.any(-1)                                                                 # (b, i)
    mask = torch.from_numpy(keys & counted[..., None]).to(attn.device, attn.dtype)
    weight = reduce(attn * mask[:, None, None], "b l h i k -> l h", "sum")
    return weight / max(int(counted.sum()), 1)

# %% answer="induction_model"
import numpy as np


def induction_model(vocab_size, max_len):
    """Every matrix built in NumPy from blocks of np.eye, then copied into the model; the standard layout."""
    V, L = vocab_size, max_len
    D = 3 * V + L
    tok, pos, prev, out = np.arange(V), V + np.arange(L), V + L + np.arange(V), 2 * V + L + np.arange(V)
    zeros = lambda: np.zeros((D, D))  # noqa: E731
    q1, k1, v1, o1, q2, k2, v2, o2 = (zeros() for _ in range(8))
    q1[pos[1:], pos[:-1]] = 30.0          # position p asks for p - 1
    k1[pos, pos] = 1.0
    v1[tok, tok], o1[tok, prev] = 1.0, 1.0
    q2[tok, tok] = 30.0                   # my token ...
    k2[prev, tok] = 1.0                   # ... against your previous token
    q2[pos, pos[0]] = 1.0                 # a constant 1 per query ...
    k2[pos[0], pos[0]] = -30.0            # ... and key 0 pushed away
    v2[tok, tok], o2[tok, out] = 1.0, 1.0
    model = AttentionOnlyModel(V, L, D)
    with torch.no_grad():
        for head, mats in zip(model.layers, ((q1, k1, v1, o1), (q2, k2, v2, o2))):
            for param, mat in zip((head.W_q, head.W_k, head.W_v, head.W_o), mats):
                param.copy_(torch.from_numpy(mat))
        embedding = np.zeros((V, D))
        embedding[tok, tok] = 1.0
        model.token_embedding.copy_(torch.from_numpy(embedding))
        positions = np.zeros((L, D))
        positions[np.arange(L), pos] = 1.0
        model.position_embedding.copy_(torch.from_numpy(positions))
        unembed = np.zeros((D, V))
        unembed[out, tok] = 1.0
        model.unembedding.copy_(torch.from_numpy(unembed))
    return model
