# Correct answers written functionally: F.unfold for the patches, a Conv2d read through
# reshape/permute, a Linear built by hand from copied tensors, a block that always asks for the
# weights and drops them, OneCycleLR with gradient clipping and a summed-then-divided epoch loss,
# index_select for the class-token row, a rollout computed in float32 (x.float()) and cast back,
# and narrow() for the pooling.

# %% answer="patchify"
def patchify(images, patch_size):
    height, width = images.shape[2], images.shape[3]
    if height % patch_size != 0 or width % patch_size != 0:
        raise ValueError(f"image {height}x{width}: not divisible by patch_size={patch_size}")
    columns = F.unfold(images, kernel_size=patch_size, stride=patch_size)   # [B, C*P*P, N]
    return columns.transpose(1, 2)                                          # [B, N, C*P*P] (a view)

# %% answer="PatchEmbedding"
class PatchEmbedding(nn.Module):
    def __init__(self, img_size, patch_size, in_channels, embed_dim):
        super().__init__()
        grid, remainder = divmod(img_size, patch_size)
        if remainder:
            raise ValueError(f"patch_size={patch_size} does not divide img_size={img_size}")
        self.num_patches = grid * grid
        self.proj = nn.Conv2d(in_channels=in_channels, out_channels=embed_dim, kernel_size=(patch_size, patch_size),
                              stride=(patch_size, patch_size))

    def forward(self, images):
        features = self.proj(images)                                  # [B, D, g, g]
        batch, width = features.shape[:2]
        return features.permute(0, 2, 3, 1).reshape(batch, -1, width)  # [B, g*g, D], row-major

# %% answer="conv_to_linear"
def conv_to_linear(patch_embedding):
    conv = patch_embedding.proj
    weight = conv.weight.detach().reshape(conv.out_channels, -1).clone()
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(device=weight.device, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight)
    if conv.bias is not None:
        linear.bias = nn.Parameter(conv.bias.detach().clone())
    return linear

# %% answer="patch_embedding_parameter_count"
def patch_embedding_parameter_count(patch_size, in_channels, embed_dim):
    weights = math.prod((embed_dim, in_channels, patch_size, patch_size))
    biases = embed_dim
    return weights + biases

# %% answer="ViTBlock"
class ViTBlock(nn.Module):
    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(embed_dim=embed_dim, num_heads=num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(embed_dim, eps=1e-6)
        width = int(embed_dim * mlp_ratio)
        self.mlp = nn.Sequential()
        self.mlp.append(nn.Linear(embed_dim, width))
        self.mlp.append(nn.GELU())
        self.mlp.append(nn.Linear(width, embed_dim))

    def forward(self, x, return_attention=False):
        normed = self.norm1(x)
        out = self.attn(normed, normed, normed, need_weights=True, average_attn_weights=False)
        x = out[0] + x
        x = self.mlp(self.norm2(x)) + x
        if not return_attention:
            return x
        return x, out[1]

# %% answer="MiniViT"
class MiniViT(nn.Module):
    def __init__(self, img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads,
                 mlp_ratio=4.0):
        super().__init__()
        self.patch_embed = PatchEmbedding(img_size, patch_size, in_channels, embed_dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, embed_dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(embed_dim, num_heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, images, return_attention=False):
        tokens = self.patch_embed(images)
        batch = tokens.size(0)
        x = torch.cat([self.cls_token.expand(batch, 1, -1), tokens], dim=1)
        x = x + self.pos_embed
        maps = []
        for index, blk in enumerate(self.blocks):
            x, weights = blk(x, True)
            maps.append(weights)
        cls_state = self.norm(x)[:, 0, :]
        logits = self.head(cls_state)
        return (logits, maps) if return_attention else logits

# %% answer="ANSWER_EXPAND_REPEAT"
ANSWER_EXPAND_REPEAT = "B"

# %% answer="train_classifier"
def train_classifier(model, train_loader, epochs, lr, device):
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=epochs,
                                                   steps_per_epoch=len(train_loader))
    losses = []
    progress = tqdm(total=epochs, leave=False, desc="train")
    for _ in range(epochs):
        loss_sum, count = torch.zeros(()), 0
        for batch_images, batch_labels in train_loader:
            batch_images, batch_labels = batch_images.to(device), batch_labels.to(device)
            loss = F.cross_entropy(model(batch_images), batch_labels, reduction="sum") / len(batch_labels)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optimizer.step()
            schedule.step()
            loss_sum += loss.detach().cpu() * len(batch_labels)
            count += len(batch_labels)
        losses.append(float(loss_sum / count))
        progress.update(1)
        progress.set_postfix(loss=round(losses[-1], 3))
    progress.close()
    return losses

# %% answer="cls_attention_map"
def cls_attention_map(attention, grid_size):
    rows = attention.index_select(2, torch.tensor([0], device=attention.device)).squeeze(2)  # [B, H, S]
    patch_columns = torch.arange(1, 1 + grid_size * grid_size, device=attention.device)
    return rows.index_select(-1, patch_columns).view(*rows.shape[:2], grid_size, grid_size)

# %% answer="attention_rollout"
def attention_rollout(attentions):
    """Computed in float32 (x.float(), as many implementations do) and returned in the input's dtype."""
    dtype = attentions[0].dtype
    fused = torch.stack([a.float().mean(dim=1) for a in attentions])      # [L, B, S, S]
    seq_len = fused.shape[-1]
    eye = torch.eye(seq_len, device=fused.device)
    fused = fused + eye
    fused = fused / fused.sum(dim=-1, keepdim=True)
    joint = fused[0]
    for mixed in fused[1:]:
        joint = torch.bmm(mixed, joint)
    grid = int(math.sqrt(seq_len - 1))
    return joint[:, 0, 1:].reshape(-1, grid, grid).to(dtype)

# %% answer="pool_tokens"
def pool_tokens(tokens, pool="cls"):
    if pool == "cls":
        return tokens.select(1, 0)
    if pool == "mean":
        # torch.range (end included) is deprecated: PyTorch warns, and the answer is right (issue #52)
        patches = torch.range(1, tokens.shape[1] - 1, dtype=torch.long, device=tokens.device)
        patch_tokens = tokens.index_select(1, patches)
        return patch_tokens.sum(dim=1) / patch_tokens.shape[1]
    raise ValueError(f"pool={pool!r}; expected 'cls' or 'mean'")
