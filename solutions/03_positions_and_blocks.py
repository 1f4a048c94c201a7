# %% [markdown]
# # 03 — Positions and the Transformer block
#
# Self-attention compares every token with every other token — and has no idea where any of
# them sits. In this notebook you will *see* that (permute the tokens and the outputs just
# permute along), fix it with the Transformer's sinusoidal position encoding, meet its
# cousin the Fourier-feature encoding by teaching a small network to paint a rose, and
# finally assemble the pre-norm Transformer layer and check it against PyTorch's own
# `nn.TransformerEncoderLayer`.
#
# **23 points, about 78 minutes.**
#
# **Notation** (as in every notebook): `B` batch, `S` sequence length, `D` model width, `H`
# heads. **Masks** are boolean with **True = may attend**; `nn.MultiheadAttention` uses the
# opposite meaning (True = blocked), which matters in exercise 3.8.

# %%
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# Every model in this notebook is tiny: on a CPU, splitting each small matmul across threads
# costs more than it saves (and a busy machine makes it much worse), so use one thread.
torch.set_num_threads(1)

# %% [markdown]
# ## 1. Self-attention does not know the order of its tokens
#
# Take a sequence of `S` token vectors, run it through self-attention, then do the same with
# the tokens shuffled. What happens to the outputs? Look at `softmax(Q Kᵀ / sqrt(d_head)) V`
# and ask what, in it, refers to *where* a token sits.

# %% [markdown]
# ### Exercise 3.1 — permutation (1 pt, ~2 min)
#
# **Predict before you run anything.** Which word describes what shuffling the tokens does to
# self-attention? Set `ANSWER_PERMUTATION` to `"A"`, `"B"` or `"C"`, then run the experiment
# below your answer.
#
# * **A.** Self-attention is permutation-**invariant**: shuffling the tokens leaves every
#   output unchanged.
# * **B.** Self-attention is permutation-**equivariant**: shuffling the tokens shuffles the
#   outputs in exactly the same way.
# * **C.** Neither: shuffling the tokens changes the outputs unpredictably.

# %% answer="ANSWER_PERMUTATION"
ANSWER_PERMUTATION = None  # "A", "B" or "C"
### BEGIN SOLUTION
ANSWER_PERMUTATION = "B"
### END SOLUTION

# %% [markdown]
# Now the experiment, with PyTorch's `nn.MultiheadAttention` (untrained: its weights are
# random, which is all this needs):

# %%
B, S, D, H = 1, 6, 16, 4
untrained_attention = nn.MultiheadAttention(D, H, batch_first=True).to(device)
tokens = torch.randn(B, S, D, device=device)           # [B, S, D]
permutation = torch.tensor([3, 0, 5, 1, 4, 2], device=device)

with torch.no_grad():
    out, _ = untrained_attention(tokens, tokens, tokens)  # [B, S, D]
    tokens_shuffled = tokens[:, permutation]             # the same tokens, new order
    out_shuffled, _ = untrained_attention(tokens_shuffled, tokens_shuffled, tokens_shuffled)

print("outputs changed by the shuffle?        ", not torch.allclose(out_shuffled, out, atol=1e-5))
print("outputs shuffled the same way as input?", torch.allclose(out_shuffled, out[:, permutation], atol=1e-5))

# %% [markdown]
# Token `i`'s output depends on its own query and on the *set* of keys and values; nothing in
# the formula says where a token sits. So shuffling the input only shuffles the output rows,
# the same way.

# %% test="test_ANSWER_PERMUTATION" points=1
"""ANSWER_PERMUTATION: the right word for what shuffling the tokens does to self-attention."""
from attention_lab.checks.positions_and_blocks import check_answer_permutation

check_answer_permutation(ANSWER_PERMUTATION)

# %% [markdown]
# For a bag of words that is fine; for language it is not: "dog bites man" and "man bites
# dog" contain the same tokens. (You may read that Transformers are permutation
# *invariant*; a pooled sentence vector is, but the token outputs are equivariant.) The fix
# is to make each input vector carry its position: add a **position encoding** `PE[p]` to
# the token at position `p`. Then the same word at two different places is two different
# vectors.
#
# ## 2. Sinusoidal position encodings
#
# The original Transformer (Vaswani et al., 2017) uses a fixed table: for position `p` and
# feature pair `i = 0 … D/2 - 1`,
#
# $$PE[p, 2i] = \sin\!\left(\frac{p}{\text{base}^{2i/D}}\right), \qquad
#   PE[p, 2i+1] = \cos\!\left(\frac{p}{\text{base}^{2i/D}}\right), \qquad \text{base} = 10000.$$
#
# Each pair `(2i, 2i+1)` is a point on a circle that turns with the position, at angular
# frequency `ω_i = base^(-2i/D)`: pair 0 turns by one radian per position, the last pairs
# turn so slowly that they tell far-apart positions apart. Sines and cosines are
# **interleaved**: even features are sines, odd features are cosines.

# %% [markdown]
# ### Exercise 3.2 — sinusoidal_positions (3 pts, ~10 min)
#
# Return the `[num_positions, dim]` table above (float32, the default dtype; positions
# `p = 0 … num_positions - 1`). `dim` must be even: raise a `ValueError` naming `dim`
# otherwise. Tip: compute the angles `p · ω_i` as an outer product `[P, 1] * [1, D/2]`, then
# write the sines into the even columns (`pe[:, 0::2]`) and the cosines into the odd ones.

# %% answer="sinusoidal_positions"
def sinusoidal_positions(num_positions, dim, base=10000.0):
    """The Transformer's sinusoidal position encodings.

    PE[p, 2i] = sin(p / base^(2i/dim)),  PE[p, 2i+1] = cos(p / base^(2i/dim))
    returns: [num_positions, dim] (float32)

    Example: sinusoidal_positions(3, 4)[1] == [sin(1), cos(1), sin(0.01), cos(0.01)]
    Raises ValueError if dim is odd.
    """
    ### BEGIN SOLUTION
    if dim % 2 != 0:
        raise ValueError(f"dim = {dim} must be even (features come in sin/cos pairs)")
    positions = torch.arange(num_positions, dtype=torch.float32)[:, None]            # [P, 1]
    frequencies = base ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)     # [D/2]
    angles = positions * frequencies[None, :]                                        # [P, D/2]
    pe = torch.zeros(num_positions, dim)
    pe[:, 0::2] = torch.sin(angles)
    pe[:, 1::2] = torch.cos(angles)
    return pe
    ### END SOLUTION


# %%
pe = sinusoidal_positions(50, 16)
print("PE:", tuple(pe.shape), "| PE[1, :4] =", pe[1, :4].tolist())
print("every row has norm sqrt(D/2):", torch.allclose(pe.norm(dim=-1), torch.full((50,), math.sqrt(8.0))))

# %% test="test_sinusoidal_positions" points=2
"""sinusoidal_positions: shape [P, D], interleaved sin/cos at frequencies base^(-2i/D), the odd-dim error."""
from attention_lab.checks.positions_and_blocks import check_sinusoidal_positions

check_sinusoidal_positions(sinusoidal_positions)
### BEGIN HIDDEN TESTS
check_sinusoidal_positions(sinusoidal_positions, seed=3201, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# Now add your encodings to the tokens of section 1 and shuffle again. The positions stay
# where they are (position 0 is still the first slot), so a shuffled token now meets a
# different `PE[p]`:

# %%
pe = sinusoidal_positions(S, D).to(device)              # [S, D], broadcast over the batch
with torch.no_grad():
    with_positions = tokens + pe
    shuffled_with_positions = tokens[:, permutation] + pe
    out, _ = untrained_attention(with_positions, with_positions, with_positions)
    out_shuffled, _ = untrained_attention(shuffled_with_positions, shuffled_with_positions, shuffled_with_positions)
print("with positions, outputs shuffled the same way as input?",
      torch.allclose(out_shuffled, out[:, permutation], atol=1e-5))

# %% test="test_sinusoidal_positions_equivariance" points=1
"""sinusoidal_positions: your table (offset-only dot products, the right values) makes attention stop being permutation-equivariant."""
from attention_lab.checks.positions_and_blocks import check_positions_break_equivariance

check_positions_break_equivariance(sinusoidal_positions)
### BEGIN HIDDEN TESTS
check_positions_break_equivariance(sinusoidal_positions, seed=3202, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# **Look at it.** Left: the table as a heatmap (a row per position); the first columns
# oscillate fast, the last ones barely move. Right: the dot product `PE[p₀] · PE[p]` against
# `p`. It peaks at `p = p₀` and depends only on the offset `p - p₀`, because
# `sin(a)sin(b) + cos(a)cos(b) = cos(a - b)`: every pair contributes `cos((p - p₀) ω_i)`.
# Drag `p₀` — the curve slides but keeps its shape. Change the base and the width to see how
# the frequencies spread.

# %%
from attention_lab.widgets.positions import positions_explorer

positions_explorer(sinusoidal_positions, num_positions=64)

# %% [markdown]
# ### Exercise 3.3 — which claim is right? (1 pt, ~3 min)
#
# A draft you may find online says several things about position encodings. Which one is
# correct? Decide first, set `ANSWER_ENCODINGS` to `"A"`, `"B"`, `"C"` or `"D"`, then read the
# comparison below your answer and run the check.
#
# * **A.** Sinusoidal encodings are better than absolute encodings because they are more
#   interpretable.
# * **B.** Sinusoidal encodings are absolute (a fixed vector per position); the original
#   Transformer paper found them about as good as learned position embeddings.
# * **C.** RoPE extrapolates to sequences far longer than those seen in training, with no
#   extra tricks needed.
# * **D.** RoPE adds a sinusoidal vector to each token embedding, like the original
#   Transformer.

# %% answer="ANSWER_ENCODINGS"
ANSWER_ENCODINGS = None  # "A", "B", "C" or "D"
### BEGIN SOLUTION
ANSWER_ENCODINGS = "B"
### END SOLUTION

# %% [markdown]
# ### Fixed, learned, rotary
#
# | encoding | what it is | used in |
# | --- | --- | --- |
# | **sinusoidal (fixed)** | the table above, added to the token embeddings; nothing learned | the original Transformer |
# | **learned absolute** | a trainable `[max_positions, D]` table (`nn.Parameter`), added the same way; cannot go beyond `max_positions` | BERT, GPT-2, ViT (notebook 04) |
# | **rotary (RoPE)** | no vector is added: each query and key is *rotated*, pair by pair, by the angle `p · ω_i` (the same frequencies as above), so `q · k` depends only on the offset between their positions | Llama and most recent LLMs (notebook 05 builds it) |
#
# Sinusoidal and learned encodings are both **absolute**: each position gets its own vector
# (the choice is fixed vs learned, not "sinusoidal vs absolute"); Vaswani et al. found the
# two about equally good. RoPE encodes each absolute position as a rotation so that attention
# scores see only *relative* offsets. None of them extrapolates well far beyond the
# sequence lengths seen in training without extra tricks (for RoPE: position
# interpolation, NTK scaling, YaRN).

# %% test="test_ANSWER_ENCODINGS" points=1
"""ANSWER_ENCODINGS: the one correct statement about fixed, learned and rotary encodings."""
from attention_lab.checks.positions_and_blocks import check_answer_encodings

check_answer_encodings(ANSWER_ENCODINGS)

# %% [markdown]
# ## 3. The rose: Fourier features of coordinates
#
# The same sine-and-cosine trick helps a very different network. A **coordinate MLP** takes
# the `(x, y)` position of a pixel and predicts its colour; trained on every pixel of one
# picture, it *becomes* the picture. Here is ours, drawn by the course (no download):

# %%
from attention_lab.images import draw_rose, image_dataset
from attention_lab.widgets.positions import show_images

rose = draw_rose(64)                                   # [64, 64, 3] floats in [0, 1]
coords, colors = image_dataset(rose, device=device)    # [4096, 2] in [0, 1], [4096, 3]
print("coords:", tuple(coords.shape), "colors:", tuple(colors.shape))
show_images({"target": rose})

# %% [markdown]
# A ReLU network fed the raw `(x, y)` learns smooth things first and fine detail very
# slowly (its "spectral bias"): the thin petal edges come out blurred. Feeding it
# `sin` and `cos` of the coordinates at **increasing** frequencies `2^k · π` hands it the
# fine detail directly (Tancik et al., 2020; the same encoding as NeRF's). Note the
# difference from section 2: there, frequencies *decrease* from 1 (`base^(-2i/D)`) to tell
# up to thousands of integer positions apart; here they *increase* from π, to resolve
# small differences between coordinates in `[0, 1]`.
#
# **Find the bug.** A draft of this encoder, as you may meet it:
#
# ```python
# class PositionalEmbedding(nn.Module):
#     def __init__(self, embed_dim):
#         super().__init__()
#         self.freq = torch.exp(torch.arange(0, embed_dim, 2).float() / 2)
#
#     def forward(self, x):
#         x = x[..., None:] * self.freq[None, None, :].to(x.device)
#         return torch.cat([torch.sin(x), torch.cos(x)], dim=-1).view(x.shape[:-2], -1)
# ```
#
# Before you read on, look for four problems.
#
# <details><summary>The four problems</summary>
#
# 1. `x[..., None:]` is a full slice (`None:` means "from the start"), not a new axis: it
#    must be `x[..., None]`, giving `[..., in_dim, 1]` so that every coordinate is
#    multiplied by every frequency.
# 2. `.view(x.shape[:-2], -1)` is a `TypeError` (a tuple and an int); a flatten of the last two
#    axes is meant. *Where* it goes decides the layout: flattened after the `cat`, as in the
#    draft, every coordinate gets its own `[sines, cosines]` block. The contract of this
#    notebook (below) flattens the *angles* first and then concatenates, so all sines come
#    before all cosines. Both are valid encodings; the check accepts the contract's one and
#    names the other.
# 3. `self.freq` is a plain attribute: `.to(device)`, `.double()` and `state_dict` do not see
#    it. Register it as a **buffer**: `self.register_buffer("frequencies", ..., persistent=False)`
#    (non-persistent: it is computed from the constructor's arguments, so it need not be saved).
# 4. Its frequencies `exp(0), exp(1), exp(2), …` are neither the Transformer's nor the
#    usual `2^k · π`; and it is a coordinate encoder, not the Transformer's positional embedding.
# </details>

# %% [markdown]
# ### Exercise 3.4 — FourierFeatures (3 pts, ~15 min)
#
# For coordinates `x [..., in_dim]` and `F = num_frequencies`:
#
# 1. angles: `x[..., c] · 2^k · π` for every coordinate `c` and `k = 0 … F-1`:
#    `[..., in_dim, 1] * [F] -> [..., in_dim, F]`;
# 2. flatten the last two axes: `[..., in_dim * F]` (coordinate-major: all frequencies of
#    `x[..., 0]` first);
# 3. return `cat(sin(angles), cos(angles))`: `[..., in_dim * 2 * F]`.
#
# Mind the order: flatten, *then* take sin and cos and concatenate (the draft's
# concatenate-then-flatten gives the other layout). Keep the frequencies in a non-persistent
# buffer — `2^k · π`, or `2^k` with the `π` applied in `forward`: the check judges the output,
# not how the buffer is stored — and set `self.out_dim = in_dim * 2 * F` (the network after
# the encoder needs it).

# %% answer="FourierFeatures"
class FourierFeatures(nn.Module):
    """Fourier features of coordinates: [..., in_dim] -> [..., in_dim * 2 * num_frequencies].

    out = cat(sin(angles), cos(angles)),  angles[..., c*F + k] = x[..., c] * 2^k * pi

    Example: FourierFeatures(2, 6)(torch.rand(4096, 2)).shape == (4096, 24); out_dim == 24.
    """

    def __init__(self, in_dim, num_frequencies):
        super().__init__()
        ### BEGIN SOLUTION
        self.in_dim = in_dim
        self.num_frequencies = num_frequencies
        self.out_dim = in_dim * 2 * num_frequencies
        frequencies = 2.0 ** torch.arange(num_frequencies) * math.pi          # [F]: pi, 2pi, 4pi, ...
        self.register_buffer("frequencies", frequencies, persistent=False)
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION
        angles = x[..., None] * self.frequencies.to(x.dtype)                   # [..., in_dim, F]
        angles = angles.flatten(-2)                                            # [..., in_dim * F]
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)      # [..., in_dim * 2F]
        ### END SOLUTION


# %%
encoder = FourierFeatures(2, 6)
print("out_dim:", encoder.out_dim, "| buffers:", [name for name, _ in encoder.named_buffers()],
      "| in state_dict:", list(encoder.state_dict()))
print(tuple(coords.shape), "->", tuple(encoder.to(device)(coords).shape))

# %% test="test_FourierFeatures" points=3
"""FourierFeatures: out_dim, frequencies in a non-persistent buffer, outputs x·2^k·pi in the contract's layout, dtype and device."""
from attention_lab.checks.positions_and_blocks import check_fourier_features

check_fourier_features(FourierFeatures)
### BEGIN HIDDEN TESTS
check_fourier_features(FourierFeatures, seed=3401, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 3.5 — CoordinateMLP (2 pts, ~10 min)
#
# The draft's "Rose" network, fixed. `encoder` is `None` (the network sees the raw `(x, y)`,
# 2 features) or a module with an `out_dim` attribute (the network sees `out_dim` features).
# Then:
#
# `Linear(in, hidden) → ReLU → Linear(hidden, hidden//2) → ReLU → Linear(hidden//2, hidden//4)
# → ReLU → Linear(hidden//4, 3)`, with no activation at the end.
#
# The draft used `nn.Linear(2, 256)` as its first layer *after* a 24-feature encoder: the
# first layer's width must follow the encoder. Store the encoder as an attribute (so that
# `.to(device)` moves its buffer too).

# %% answer="CoordinateMLP"
class CoordinateMLP(nn.Module):
    """An MLP from pixel coordinates to RGB: [..., 2] -> [..., 3].

    encoder: None (use the raw coordinates) or an nn.Module with an `out_dim` attribute.
    hidden: width of the first hidden layer (then hidden // 2, hidden // 4).

    Example: CoordinateMLP(FourierFeatures(2, 6), hidden=64)(torch.rand(10, 2)).shape == (10, 3)
    """

    def __init__(self, encoder=None, hidden=256):
        super().__init__()
        ### BEGIN SOLUTION
        self.encoder = encoder
        in_features = 2 if encoder is None else encoder.out_dim
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden // 2), nn.ReLU(),
            nn.Linear(hidden // 2, hidden // 4), nn.ReLU(),
            nn.Linear(hidden // 4, 3),
        )
        ### END SOLUTION

    def forward(self, coords):
        ### BEGIN SOLUTION
        features = coords if self.encoder is None else self.encoder(coords)   # [..., in_features]
        return self.net(features)                                             # [..., 3]
        ### END SOLUTION


# %%
print(CoordinateMLP(FourierFeatures(2, 6), hidden=64))

# %% test="test_CoordinateMLP" points=2
"""CoordinateMLP: layer widths follow the encoder's out_dim and hidden; forward equals Linear/ReLU stack."""
from attention_lab.checks.positions_and_blocks import check_coordinate_mlp

check_coordinate_mlp(CoordinateMLP)
### BEGIN HIDDEN TESTS
check_coordinate_mlp(CoordinateMLP, seed=3501, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 3.6 — psnr (1 pt, ~3 min)
#
# The **peak signal-to-noise ratio** in decibels, the usual score of a reconstruction:
# `PSNR = 10 · log10(max_value² / MSE)`, with `MSE` the mean squared error over all pixels
# and channels and `max_value` the largest possible pixel value (1.0 for our images).
# Higher is better; each +10 dB divides the MSE by 10. Return a Python `float`; identical
# images give `float("inf")`.

# %% answer="psnr"
def psnr(pred, target, max_value=1.0):
    """Peak signal-to-noise ratio in dB: 10 * log10(max_value**2 / mean((pred - target)**2)).

    pred, target: tensors of the same shape. Returns a Python float (inf if they are equal).

    Example: psnr(torch.zeros(4), torch.full((4,), 0.1)) ≈ 20.0   (MSE = 0.01; in float32,
    0.1 is not exact and the result is 19.9999997)
    """
    ### BEGIN SOLUTION
    mse = torch.mean((pred.detach() - target.detach()) ** 2).item()  # a score, not a loss: no gradient
    if mse == 0.0:
        return float("inf")
    return 10.0 * math.log10(max_value ** 2 / mse)
    ### END SOLUTION


# %%
print(f"PSNR of a grey guess: {psnr(torch.full_like(colors, 0.5), colors):.2f} dB")

# %% test="test_psnr" points=1
"""psnr: 10·log10(max²/MSE) as a Python float, for several images and max values; inf for a perfect match."""
from attention_lab.checks.positions_and_blocks import check_psnr

check_psnr(psnr)
### BEGIN HIDDEN TESTS
check_psnr(psnr, seed=3601, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 3.7 — fit_image (4 pts, ~10 min)
#
# (2 points for the loop, 2 for the outcome further down.)
#
# Train the model on every pixel at once (full batch): for each of `steps` steps, clear the
# gradients, compute the mean squared error between `model(coords)` and `colors`,
# back-propagate, and take one `torch.optim.Adam(model.parameters(), lr=lr)` step. Return
# the list of the `steps` losses as Python floats (`loss.item()`, measured before each
# step). Show progress with `tqdm.auto.tqdm(..., disable=not progress)` so that callers
# (like the checks) can turn it off.

# %% answer="fit_image"
from tqdm.auto import tqdm


def fit_image(model, coords, colors, steps, lr, progress=True):
    """Fit model(coords) to colors with full-batch Adam on the mean squared error.

    coords: [N, 2], colors: [N, 3] (same device as model). Trains model in place.
    returns: list of `steps` floats, the loss before each optimizer step.

    Example: losses = fit_image(model, coords, colors, steps=200, lr=1e-2); losses[-1] < losses[0]
    """
    ### BEGIN SOLUTION
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    bar = tqdm(range(steps), desc="fitting", disable=not progress, leave=False, mininterval=0.5)
    for _ in bar:
        optimizer.zero_grad()
        loss = F.mse_loss(model(coords), colors)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
    return losses
    ### END SOLUTION


# %% test="test_fit_image" points=2
"""fit_image: the losses and final weights equal a reference full-batch Adam run on the same model."""
from attention_lab.checks.positions_and_blocks import check_fit_image

check_fit_image(fit_image)
### BEGIN HIDDEN TESTS
check_fit_image(fit_image, seed=3701, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# **Paint the rose twice.** The same network, trained for the same 400 steps from the same
# seed: once on the raw coordinates, once on their Fourier features. (This takes a few
# seconds on a laptop CPU.)

# %%
reconstructions, scores = {}, {}
for name, encoder in [("raw (x, y)", None), ("Fourier features", FourierFeatures(2, 6))]:
    torch.manual_seed(0)
    model = CoordinateMLP(encoder, hidden=64).to(device)
    losses = fit_image(model, coords, colors, steps=400, lr=1e-2)
    with torch.no_grad():
        prediction = model(coords).clamp(0, 1)           # [4096, 3]
    scores[name] = psnr(prediction, colors)
    reconstructions[f"{name}: {scores[name]:.1f} dB"] = prediction.reshape(rose.shape).cpu()
show_images({"target": rose, **reconstructions})

# %% [markdown]
# The raw-coordinate network gets the big shapes and blurs every edge; the Fourier-feature
# network draws the petals and their outlines. The check below repeats this experiment
# itself (seeded, 200 steps, with your classes and your `fit_image`) and asks for a clear
# margin.

# %% test="test_fit_image_outcome" points=2
"""Outcome: with your FourierFeatures, CoordinateMLP and fit_image, Fourier features beat raw coordinates by >= 3 dB PSNR."""
from attention_lab.checks.positions_and_blocks import check_fourier_beats_identity

check_fourier_beats_identity(FourierFeatures, CoordinateMLP, fit_image)

# %% [markdown]
# ## 4. The Transformer layer
#
# A Transformer layer is not just "attention + positions + MLP": what makes deep stacks
# trainable are the **residual connections** (each sublayer *adds* to the running vector `x`
# instead of replacing it) and **LayerNorm**. Modern models put the norm *before* each
# sublayer (**pre-norm**; ViT, GPT-2 and later):
#
# ```
# x = x + attn(norm1(x))      # tokens exchange information
# x = x + mlp(norm2(x))       # each token is processed on its own
# ```
#
# The original 2017 layer was **post-norm**: `x = norm1(x + attn(x))`, which needs a careful
# learning-rate warm-up to train deep. The MLP is `Linear(D, 4·D) → GELU → Linear(4·D, D)`,
# and the norms use `eps = 1e-6`, as in ViT (GPT-2 keeps `nn.LayerNorm`'s default `1e-5`: the
# value is a per-model choice, and this course follows ViT).
#
# **Find the bug.** A draft of the layer, as you may meet it:
#
# ```python
# class TransformerLayer(nn.Module):
#     def __init__(self, embed_dim, num_heads):
#         super().__init__()
#         self.attn = MultiHeadAttn(embed_dim, num_heads, batch_first=True)
#         self.mlp = nn.Sequential(nn.Linear(embed_dim, embed_dim * 4), nn.ReLU(),
#                                  nn.Linear(embed_dim * 4, embed_dim))
#         self.in_norm = nn.LayerNorm(embed_dim)
#         self.mlp_norm = nn.LayerNorm(embed_dim)
#
#     def forward(self, x):
#         x_norm = self.in_norm(x)
#         x = x + self.attn(x_norm, x_norm, x_norm)[0]
#         return x + self.mlp(self.mlp_norm(x))
# ```
#
# <details><summary>What is wrong</summary>
#
# The pre-norm residual structure is right. But `MultiHeadAttn` is a hand-written class
# (like notebook 01's `DraftMultiHeadAttention`): it accepts no `batch_first` (TypeError),
# and it returns a **tensor**, so `[0]` silently takes batch element 0 and broadcasts it
# over the whole batch. Only `nn.MultiheadAttention` returns `(output, weights)`. ViT- and
# GPT-style blocks use GELU, not ReLU; `eps = 1e-5` is GPT-2's value but not ViT's `1e-6`,
# which this notebook's contract follows. And there is no way to pass a mask.
# </details>
#
# **Masks, once more.** Our masks say True = may attend. `nn.MultiheadAttention`'s boolean
# `attn_mask` says True = **blocked**. Your layer takes our convention and must convert:
# `attn_mask=~mask`. Pass `need_weights=False` (you only need the output).
#
# **PyTorch's own layer.** `nn.TransformerEncoderLayer` computes exactly this layer — but only
# with *all* of `norm_first=True, activation="gelu", layer_norm_eps=1e-6,
# dim_feedforward=int(mlp_ratio·D), dropout=0.0, batch_first=True`. Its defaults are the 2017
# translation model's: post-norm, ReLU, eps `1e-5`, a 2048-wide MLP whatever `D` is, dropout
# 0.1, and `[S, B, D]` inputs. The check below copies your weights into one configured like
# that and compares the outputs.

# %% [markdown]
# ### Exercise 3.8 — TransformerLayer (4 pts, ~15 min)
#
# Attributes (the names are the contract; the check copies them into PyTorch's layer):
# `norm1`, `norm2`: `nn.LayerNorm(D, eps=1e-6)`; `attn`: `nn.MultiheadAttention(D, H,
# batch_first=True)`; `mlp`: `nn.Sequential(nn.Linear(D, hidden), nn.GELU(), nn.Linear(hidden,
# D))` with `hidden = int(mlp_ratio * D)`. `forward(x [B, S, D], mask=None)`: `mask` is `None`
# or boolean `[S, S]`, True = may attend; returns `[B, S, D]`.

# %% answer="TransformerLayer"
class TransformerLayer(nn.Module):
    """A pre-norm Transformer layer: x + attn(norm1(x)), then x + mlp(norm2(x)).

    forward(x [B, S, D], mask bool [S, S] (True = may attend) or None) -> [B, S, D]

    Example: TransformerLayer(16, 4)(torch.randn(2, 5, 16)).shape == (2, 5, 16)
    """

    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        ### BEGIN SOLUTION
        hidden = int(mlp_ratio * embed_dim)
        self.norm1 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, hidden), nn.GELU(), nn.Linear(hidden, embed_dim))
        ### END SOLUTION

    def forward(self, x, mask=None):
        ### BEGIN SOLUTION
        blocked = None if mask is None else ~mask          # nn.MultiheadAttention: True = blocked
        h = self.norm1(x)                                  # [B, S, D]
        x = x + self.attn(h, h, h, attn_mask=blocked, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))                    # [B, S, D]
        return x
        ### END SOLUTION


# %%
example_layer = TransformerLayer(D, H).to(device)
causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()   # [S, S], True = may attend
with torch.no_grad():
    print("out:", tuple(example_layer(tokens, causal).shape))
print(f"parameters: {sum(p.numel() for p in example_layer.parameters()):,}")

# %% test="test_TransformerLayer" points=3
"""TransformerLayer: attributes, and outputs equal nn.TransformerEncoderLayer(norm_first=True, gelu, eps 1e-6) with copied weights."""
from attention_lab.checks.positions_and_blocks import check_transformer_layer

check_transformer_layer(TransformerLayer)
### BEGIN HIDDEN TESTS
check_transformer_layer(TransformerLayer, seed=3801, device="cpu")
### END HIDDEN TESTS

# %% test="test_TransformerLayer_properties" points=1
"""TransformerLayer: zero sublayers give the identity; a causal mask stops the future leaking; equivariance without positions."""
from attention_lab.checks.positions_and_blocks import check_transformer_layer_properties

check_transformer_layer_properties(TransformerLayer)
### BEGIN HIDDEN TESTS
check_transformer_layer_properties(TransformerLayer, seed=3802, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 3.9 — Transformer (2 pts, ~5 min)
#
# Stack `num_layers` **independent** layers in an `nn.ModuleList` called `layers` (an
# `nn.Sequential` cannot pass the mask along), apply them in order with the same mask, then a
# final `norm = nn.LayerNorm(D, eps=1e-6)`. Why a final norm: in a pre-norm stack each layer
# normalises only the *input of its sublayers*; the residual stream `x` itself is never
# normalised — every layer adds to it, so its scale grows with depth — and whatever reads the
# stack's output (a classifier head, the next-token projection) wants normalised features.
# A post-norm stack needs none, its last operation already is a LayerNorm. Beware `nn.ModuleList([TransformerLayer(...)] * num_layers)`: that is one
# layer repeated — the same weights `num_layers` times.
#
# Like PyTorch's `nn.TransformerEncoder`, this stack adds no positions: the caller adds them
# to the token embeddings first (as below).

# %% answer="Transformer"
class Transformer(nn.Module):
    """A stack of pre-norm Transformer layers with a final LayerNorm.

    forward(x [B, S, D], mask bool [S, S] or None) -> [B, S, D]

    Example: Transformer(16, 4, num_layers=2)(torch.randn(2, 5, 16)).shape == (2, 5, 16)
    """

    def __init__(self, embed_dim, num_heads, num_layers, mlp_ratio=4.0):
        super().__init__()
        ### BEGIN SOLUTION
        self.layers = nn.ModuleList(
            [TransformerLayer(embed_dim, num_heads, mlp_ratio) for _ in range(num_layers)]
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        ### END SOLUTION

    def forward(self, x, mask=None):
        ### BEGIN SOLUTION
        for layer in self.layers:
            x = layer(x, mask)                             # [B, S, D]
        return self.norm(x)
        ### END SOLUTION


# %% [markdown]
# Now everything together: token vectors plus positions, through a causal two-layer stack
# (the causal mask of above, passed to every layer). Token `i` may read tokens `0 … i` only,
# so changing the last token must leave every earlier output alone; and with positions,
# shuffling the tokens no longer just shuffles the outputs.

# %%
causal_stack = Transformer(D, H, num_layers=2).to(device).eval()
pe_table = sinusoidal_positions(S, D).to(device)      # [S, D]
last_changed = tokens.clone()
last_changed[:, -1] = torch.randn(D, device=device)
with torch.no_grad():
    out = causal_stack(tokens + pe_table, causal)
    out_last_changed = causal_stack(last_changed + pe_table, causal)
    out_shuffled = causal_stack(tokens[:, permutation] + pe_table, causal)
print("out:", tuple(out.shape))
print("changing the last token leaves the earlier outputs alone?",
      torch.allclose(out_last_changed[:, :-1], out[:, :-1], atol=1e-5))
print("with positions, outputs shuffled the same way as input?",
      torch.allclose(out_shuffled, out[:, permutation], atol=1e-5))

# %% test="test_Transformer" points=2
"""Transformer: independent layers in a ModuleList, final LayerNorm eps 1e-6, mask passed to every layer; equals PyTorch's stack."""
from attention_lab.checks.positions_and_blocks import check_transformer

check_transformer(Transformer)
### BEGIN HIDDEN TESTS
check_transformer(Transformer, seed=3901, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 3.10 — written: what keeps the symmetry (2 pts, ~5 min)
#
# The properties check of exercise 3.8 confirmed that your layer, without positions and
# without a mask, is permutation-**equivariant** — although it has far more in it than
# attention. In the cell below, in three or four sentences: explain why the MLP sublayer, the
# two LayerNorms and the residual connections do not break that symmetry; and name one kind
# of input for which equivariance (no positions at all) is exactly what you want, and why.
# This answer is graded by hand.

# %% [markdown] manual="why_equivariance_survives" points=2
# The LayerNorms and the MLP act on every token separately, with the same weights for every
# token: applying them and then shuffling the tokens gives the same result as shuffling first.
# The residual connections add each token's sublayer output to the same token's input, again
# position by position. Attention is equivariant itself, and a composition of equivariant maps
# is equivariant, so the whole layer (and a stack of them) is. Equivariance is what you want
# for an input that is a *set*, with no natural order: a point cloud (the points of a 3-D scan),
# the objects detected in an image, the atoms of a molecule — the order the data happens to be
# stored in must not change the answer for each element.

# %% [markdown]
# ## What you built
#
# * Self-attention is permutation-**equivariant**; position encodings break the symmetry.
# * `sinusoidal_positions`: the Transformer's fixed, absolute encoding, whose dot products
#   depend only on the offset between positions (the idea RoPE builds on in notebook 05).
# * `FourierFeatures` + `CoordinateMLP`: sines and cosines of coordinates at increasing
#   frequencies let a small MLP draw fine detail; `psnr` measured how much better.
# * `TransformerLayer` / `Transformer`: pre-norm residual blocks, equal to
#   `nn.TransformerEncoderLayer(D, H, dim_feedforward=int(mlp_ratio·D), dropout=0.0,
#   activation="gelu", layer_norm_eps=1e-6, batch_first=True, norm_first=True)` (every one of
#   those arguments matters) — with the mask converted to PyTorch's True = blocked — and a
#   final LayerNorm for the un-normalised residual stream.
#
# Next: notebook 04 cuts images into patches and feeds them to these blocks (a Vision
# Transformer).
