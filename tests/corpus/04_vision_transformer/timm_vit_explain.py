# Correct answers in the style of timm's VisionTransformer and vit-explain: Tensor.unfold behind
# a helper named `patches`, blocks called by keyword (block(x=x)), trunc-normal init,
# forward_features / forward_head, a `predict` helper inside the training loop, a cosine
# schedule, vit-explain's `rollout` helper with a float32 torch.eye, timm's global_pool.

# %% answer="patchify"
def patches(images, size):
    """[B, C, H, W] -> [B, N, C*P*P] with Tensor.unfold: windows of `size` with stride `size`."""
    batch, channels = images.shape[:2]
    windows = images.unfold(2, size, size).unfold(3, size, size)      # [B, C, H/P, W/P, P, P]
    windows = windows.permute(0, 2, 3, 1, 4, 5)                        # [B, H/P, W/P, C, P, P]
    return windows.reshape(batch, -1, channels * size * size)


def patchify(images, patch_size):
    height, width = images.shape[-2:]
    if height % patch_size != 0 or width % patch_size != 0:
        raise ValueError(f"Input image size ({height}*{width}) doesn't match patch size {patch_size}.")
    return patches(images, patch_size)

# %% answer="PatchEmbedding"
class PatchEmbedding(nn.Module):
    """timm's PatchEmbed, reduced to square images."""

    def __init__(self, img_size, patch_size, in_channels, embed_dim):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} should be divisible by patch_size {patch_size}")
        self.img_size, self.patch_size = (img_size, img_size), (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size, bias=True)

    def forward(self, x):
        x = self.proj(x)
        return x.flatten(2).transpose(1, 2)  # NCHW -> NLC

# %% answer="conv_to_linear"
def conv_to_linear(patch_embedding):
    conv = patch_embedding.proj
    linear = nn.Linear(conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1], conv.out_channels,
                       bias=conv.bias is not None).to(conv.weight)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.flatten(1))
        if conv.bias is not None:
            linear.bias.copy_(conv.bias)
    return linear

# %% answer="patch_embedding_parameter_count"
def patch_embedding_parameter_count(patch_size, in_channels, embed_dim):
    conv = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size, device="meta")
    return sum(parameter.numel() for parameter in conv.parameters())

# %% answer="ViTBlock"
class ViTBlock(nn.Module):
    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(embed_dim, eps=1e-6)
        hidden_features = int(embed_dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, hidden_features), nn.GELU(), nn.Linear(hidden_features, embed_dim))

    def _attend(self, x, need_weights):
        return self.attn(x, x, x, need_weights=need_weights, average_attn_weights=False)

    def forward(self, x, return_attention=False):
        attended, weights = self._attend(self.norm1(x), need_weights=return_attention)
        x = x + attended
        x = x + self.mlp(self.norm2(x))
        if return_attention:
            return x, weights
        return x

# %% answer="MiniViT"
class MiniViT(nn.Module):
    def __init__(self, img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads,
                 mlp_ratio=4.0):
        super().__init__()
        self.patch_embed = PatchEmbedding(img_size=img_size, patch_size=patch_size, in_channels=in_channels,
                                          embed_dim=embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, embed_dim) * 0.02)
        self.blocks = nn.ModuleList([ViTBlock(embed_dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio)
                                     for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)

    def _pos_embed(self, x):
        return torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed

    def forward_features(self, images, return_attention):
        x = self._pos_embed(self.patch_embed(images))
        attentions = []
        for block in self.blocks:
            if return_attention:
                x, attention = block(x=x, return_attention=True)
                attentions.append(attention)
            else:
                x = block(x=x)
        return self.norm(x), attentions

    def forward_head(self, x):
        return self.head(x[:, 0])

    def forward(self, images, return_attention=False):
        x, attentions = self.forward_features(images, return_attention)
        logits = self.forward_head(x)
        return (logits, attentions) if return_attention else logits

# %% answer="ANSWER_EXPAND_REPEAT"
ANSWER_EXPAND_REPEAT = "B"  # the same summed gradient; repeat only costs memory

# %% answer="train_classifier"
def predict(model, images):
    """The logits of a batch (a helper the loop calls; it keeps the graph for backward)."""
    return model(images)


def train_classifier(model, train_loader, epochs, lr, device):
    model = model.to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(train_loader))
    history = []
    for epoch in tqdm(range(epochs), leave=False, desc="epochs"):
        running, seen = 0.0, 0
        for images, targets in train_loader:
            images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(predict(model, images), targets)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += loss.item() * images.size(0)
            seen += images.size(0)
        history.append(running / seen)
    return history

# %% answer="cls_attention_map"
def cls_attention_map(attention, grid_size):
    return attention[..., 0, 1:].unflatten(-1, (grid_size, grid_size))

# %% answer="attention_rollout"
def rollout(attentions, discard_ratio=0.0, head_fusion="mean"):
    """vit-explain's rollout (its discard_ratio left at 0, which keeps every weight)."""
    result = torch.eye(attentions[0].size(-1))
    with torch.no_grad():
        for attention in attentions:
            if head_fusion == "mean":
                attention_heads_fused = attention.mean(axis=1)
            elif head_fusion == "max":
                attention_heads_fused = attention.max(axis=1)[0]
            else:
                raise ValueError("Attention head fusion type Not supported")
            identity = torch.eye(attention_heads_fused.size(-1))
            a = (attention_heads_fused + 1.0 * identity) / 2
            a = a / a.sum(dim=-1, keepdim=True)
            result = torch.matmul(a, result)
    mask = result[:, 0, 1:]
    width = int(mask.size(-1) ** 0.5)
    return mask.reshape(-1, width, width)


def attention_rollout(attentions):
    return rollout([a.cpu() for a in attentions]).to(attentions[0].device)

# %% answer="pool_tokens"
def pool_tokens(tokens, pool="cls"):
    num_prefix_tokens = 1
    if pool == "mean":  # timm: global_pool="avg"
        return tokens[:, num_prefix_tokens:].mean(dim=1)
    elif pool == "cls":  # timm: global_pool="token"
        return tokens[:, 0]
    raise ValueError(f"Invalid pool type: {pool}")
