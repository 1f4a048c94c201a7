# Correct answers written with einops and in the style of DINO's attention extraction: rearrange
# for patches and tokens, a module-level `attention` helper the block calls, the class token
# copied with einops.repeat, a last-block attention read DINO-style (attentions[:, :, 0, 1:]),
# a `heads` helper, plain Adam with a constant learning rate, rollout accumulated from the last
# block with 0.5·A + 0.5·I, mean pooling with einsum weights.

# %% answer="patchify"
from einops import rearrange


def patchify(images, patch_size):
    *_, height, width = images.shape
    if height % patch_size or width % patch_size:
        raise ValueError(f"{height}x{width} images cannot be cut into {patch_size}x{patch_size} patches")
    return rearrange(images, "b c (h p1) (w p2) -> b (h w) (c p1 p2)", p1=patch_size, p2=patch_size)

# %% answer="PatchEmbedding"
from einops import rearrange


class PatchEmbedding(nn.Module):
    def __init__(self, img_size, patch_size, in_channels, embed_dim):
        super().__init__()
        if img_size % patch_size != 0:
            raise ValueError(f"img_size={img_size} is not a multiple of patch_size={patch_size}")
        self.num_patches = (img_size // patch_size) * (img_size // patch_size)
        self.proj = nn.Conv2d(in_channels, embed_dim, patch_size, patch_size)

    def forward(self, images):
        return rearrange(self.proj(images), "b d gh gw -> b (gh gw) d")

# %% answer="conv_to_linear"
def conv_to_linear(patch_embedding):
    weight = patch_embedding.proj.weight
    bias = patch_embedding.proj.bias
    out_features, in_features = weight.shape[0], weight[0].numel()
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device=weight.device, dtype=weight.dtype)
    state = {"weight": rearrange(weight.detach(), "d c p q -> d (c p q)").clone()}
    if bias is not None:
        state["bias"] = bias.detach().clone()
    linear.load_state_dict(state)
    return linear

# %% answer="patch_embedding_parameter_count"
def patch_embedding_parameter_count(patch_size, in_channels, embed_dim):
    return (in_channels * patch_size ** 2 + 1) * embed_dim

# %% answer="ViTBlock"
def attention(attn, x, need_weights):
    """Self-attention on already normalised tokens; per-head weights when asked (DINO reads them)."""
    out, weights = attn(x, x, x, need_weights=need_weights, average_attn_weights=False)
    return out, weights


class ViTBlock(nn.Module):
    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, int(embed_dim * mlp_ratio)), nn.GELU(),
                                 nn.Linear(int(embed_dim * mlp_ratio), embed_dim))

    def forward(self, x, return_attention=False):
        y, attn_weights = attention(self.attn, self.norm1(x), need_weights=True)
        x = x + y
        x = x + self.mlp(self.norm2(x))
        return (x, attn_weights) if return_attention else x

# %% answer="MiniViT"
from einops import repeat


class MiniViT(nn.Module):
    def __init__(self, img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads,
                 mlp_ratio=4.0):
        super().__init__()
        self.patch_embed = PatchEmbedding(img_size, patch_size, in_channels, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.patch_embed.num_patches, embed_dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            self.blocks.append(ViTBlock(embed_dim, num_heads, mlp_ratio))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)

    def prepare_tokens(self, images):
        x = self.patch_embed(images)
        cls_tokens = repeat(self.cls_token, "1 1 d -> b 1 d", b=x.shape[0])   # a copy per image
        x = torch.cat((cls_tokens, x), dim=1)
        return x + self.pos_embed

    def forward(self, images, return_attention=False):
        x = self.prepare_tokens(images)
        attentions = []
        for blk in self.blocks:
            x, attn = blk(x, return_attention=True)
            attentions.append(attn)
        x = self.norm(x)
        logits = self.head(x[:, 0])
        if return_attention:
            return logits, attentions
        return logits

# %% answer="ANSWER_EXPAND_REPEAT"
ANSWER_EXPAND_REPEAT = "b"

# %% answer="train_classifier"
def train_classifier(model, train_loader, epochs, lr, device):
    model.to(device)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    criterion = nn.CrossEntropyLoss()
    epoch_losses = []
    bar = tqdm(range(epochs), leave=False)
    for epoch in bar:
        losses = []
        for images, labels in train_loader:
            logits = model(images.to(device))
            loss = criterion(logits, labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        epoch_losses.append(sum(losses) / len(losses))
        bar.set_postfix(loss=epoch_losses[-1])
    return epoch_losses

# %% answer="cls_attention_map"
def heads(attention):
    """How many heads an attention tensor [B, H, S, S] has."""
    return attention.shape[1]


def cls_attention_map(attention, grid_size):
    batch = attention.shape[0]
    # DINO: attentions[0, :, 0, 1:].reshape(nh, w_featmap, h_featmap), for every image here
    cls_row = attention[:, :, 0, 1:]
    return cls_row.reshape(batch, heads(attention), grid_size, grid_size)

# %% answer="attention_rollout"
def attention_rollout(attentions):
    seq_len = attentions[0].shape[-1]
    eye = torch.eye(seq_len, dtype=attentions[0].dtype, device=attentions[0].device)
    joint = None
    for layer_attention in reversed(list(attentions)):       # from the last block down
        mixed = 0.5 * layer_attention.mean(dim=1) + 0.5 * eye
        joint = mixed if joint is None else joint @ mixed
    grid = math.isqrt(seq_len - 1)
    return rearrange(joint[:, 0, 1:], "b (h w) -> b h w", h=grid, w=grid)

# %% answer="pool_tokens"
def pool_tokens(tokens, pool="cls"):
    if pool not in {"cls", "mean"}:
        raise ValueError(f"unknown pooling {pool!r}: use 'cls' or 'mean'")
    weights = torch.zeros(tokens.shape[1], dtype=tokens.dtype, device=tokens.device)
    if pool == "cls":
        weights[0] = 1
    else:
        weights[1:] = 1 / (tokens.shape[1] - 1)
    return torch.einsum("bsd,s->bd", tokens, weights)
