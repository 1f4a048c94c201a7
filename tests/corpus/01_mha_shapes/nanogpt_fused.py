# Correct answers in the style of nanoGPT/minGPT: one fused q|k|v projection split with .split,
# (B, T, nh, hs) views, float32 internal compute cast back with .type_as, unflatten, -inf masks
# through torch.where, PaLM-style FLOP accounting for a fused c_attn.

# %% answer="split_heads"
def split_heads(x, num_heads):
    B, T, C = x.size()
    if C % num_heads:
        raise ValueError(f"n_embd ({C}) must be divisible by n_head ({num_heads})")
    return x.unflatten(-1, (num_heads, C // num_heads)).permute(0, 2, 1, 3)  # (B, nh, T, hs), not contiguous

# %% answer="merge_heads"
def merge_heads(x):
    return torch.cat(x.unbind(dim=1), dim=-1)  # side by side: (B, T, nh * hs)

# %% answer="split_heads_einops"
from einops import rearrange as einops_rearrange


def split_heads_einops(x, num_heads):
    if x.shape[-1] % num_heads:
        raise ValueError(f"n_embd ({x.shape[-1]}) must be divisible by n_head ({num_heads})")
    return einops_rearrange(x, "B T (nh hs) -> B nh T hs", nh=num_heads)

# %% answer="attention_weights"
def attention_weights(q, k, mask=None):
    att = (q.float() @ k.float().mT) * (1.0 / math.sqrt(k.size(-1)))  # float32 inside, like mixed precision
    if mask is not None:
        att = torch.where(mask, att, float("-inf"))
    return F.softmax(att, dim=-1).type_as(q)

# %% answer="scaled_dot_product_attention"
def scaled_dot_product_attention(q, k, v, mask=None):
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    if mask is not None:
        att.masked_fill_(mask.logical_not(), float("-inf"))  # in place, on the fresh score tensor
    att = F.softmax(att, dim=-1)
    y = att @ v
    return y, att

# %% answer="MultiHeadSelfAttention"
class MultiHeadSelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__()
        assert embed_dim % num_heads == 0
        self.q_linear = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_linear = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_linear = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_linear = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.n_head, self.n_embd = num_heads, embed_dim

    def forward(self, x, mask=None, return_weights=False):
        B, T, C = x.size()
        layers = (self.q_linear, self.k_linear, self.v_linear)
        weight = torch.cat([layer.weight for layer in layers])  # one fused c_attn, as in nanoGPT
        bias = torch.cat([layer.bias for layer in layers]) if self.q_linear.bias is not None else None
        q, k, v = F.linear(x, weight, bias).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if mask is not None:
            att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        y = self.out_linear(y)
        return (y, att) if return_weights else y

# %% answer="load_torch_mha_weights"
@torch.no_grad()
def load_torch_mha_weights(module, torch_mha):
    q_w, k_w, v_w = torch_mha.in_proj_weight.tensor_split(3)
    module.q_linear.weight.copy_(q_w)
    module.k_linear.weight.copy_(k_w)
    module.v_linear.weight.copy_(v_w)
    module.out_linear.weight.copy_(torch_mha.out_proj.weight)
    if torch_mha.in_proj_bias is not None:
        for layer, b in zip((module.q_linear, module.k_linear, module.v_linear), torch_mha.in_proj_bias.tensor_split(3)):
            layer.bias.copy_(b)
        module.out_linear.bias.copy_(torch_mha.out_proj.bias)

# %% answer="attention_layer_flops"
def attention_layer_flops(batch_size, seq_len, d_model):
    # PaLM-style accounting: 2 FLOPs per multiply-add; c_attn is one fused [C, 3C] matmul, c_proj [C, C]
    B, T, C = batch_size, seq_len, d_model
    c_attn = 2 * B * T * C * 3 * C
    c_proj = 2 * B * T * C * C
    att = 2 * B * T * T * C  # q @ k.transpose(-2, -1), all heads
    y = 2 * B * T * T * C  # att @ v
    return dict(projections=c_attn + c_proj, attention=att + y)

# %% answer="block_flops"
def block_flops(batch_size, seq_len, d_model, mlp_ratio=4):
    B, T, C = batch_size, seq_len, d_model
    hidden = int(mlp_ratio * C)
    c_fc, c_proj = 2 * B * T * C * hidden, 2 * B * T * hidden * C  # nanoGPT's MLP
    return dict(attention_layer_flops(B, T, C), mlp=c_fc + c_proj)

# %% answer="ANSWER_ATTENTION_CROSSOVER"
D = 768
ANSWER_ATTENTION_CROSSOVER = (8 * D * D + 16 * D * D) / (4 * D)  # a float: 4608.0

# %% answer="ANSWER_DRAFT_BUG"
ANSWER_DRAFT_BUG = " B "
