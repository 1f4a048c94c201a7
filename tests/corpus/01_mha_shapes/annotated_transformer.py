# Correct answers in the style of the Annotated Transformer: an `attention(query, key, value, mask)`
# helper that the module uses, -1e9 masks filled where mask == 0, view/transpose/contiguous, .size().

# %% answer="split_heads"
def split_heads(x, num_heads):
    nbatches, d_model = x.size(0), x.size(-1)
    if d_model % num_heads != 0:
        raise ValueError("d_model=%d must be a multiple of h=%d" % (d_model, num_heads))
    return x.view(nbatches, -1, num_heads, d_model // num_heads).transpose(1, 2)

# %% answer="merge_heads"
def merge_heads(x):
    nbatches, h, _, d_k = x.size()
    return x.transpose(1, 2).contiguous().view(nbatches, -1, h * d_k)

# %% answer="split_heads_einops"
from einops.layers.torch import Rearrange


def split_heads_einops(x, num_heads):
    # einops' layer form, as in nn.Sequential models: built for this head count, then applied
    if x.size(-1) % num_heads != 0:
        raise ValueError("d_model=%d must be a multiple of h=%d" % (x.size(-1), num_heads))
    to_heads = Rearrange("batch seq (heads d_k) -> batch heads seq d_k", heads=num_heads)
    return to_heads(x)

# %% answer="attention_weights"
def attention(query, key, value, mask=None):
    "Compute 'Scaled Dot Product Attention'"
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    return torch.matmul(p_attn, value), p_attn


def attention_weights(q, k, mask=None):
    _, p_attn = attention(q, k, k, mask)
    return p_attn

# %% answer="scaled_dot_product_attention"
def scaled_dot_product_attention(q, k, v, mask=None):
    return attention(query=q, key=k, value=v, mask=mask)

# %% answer="MultiHeadSelfAttention"
class MultiHeadSelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, bias=True):
        "Take in model size and number of heads."
        super().__init__()
        assert embed_dim % num_heads == 0
        self.d_k = embed_dim // num_heads
        self.h = num_heads
        self.q_linear, self.k_linear, self.v_linear, self.out_linear = (
            nn.Linear(embed_dim, embed_dim, bias=bias) for _ in range(4))

    def forward(self, x, mask=None, return_weights=False):
        nbatches = x.size(0)
        query, key, value = [
            lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
            for lin in (self.q_linear, self.k_linear, self.v_linear)
        ]
        x, self.attn = attention(query, key, value, mask=mask)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        out = self.out_linear(x)
        return (out, self.attn) if return_weights else out

# %% answer="load_torch_mha_weights"
def load_torch_mha_weights(module, torch_mha):
    d = module.q_linear.in_features
    for i, lin in enumerate([module.q_linear, module.k_linear, module.v_linear]):
        lin.weight.data[:] = torch_mha.in_proj_weight.data[i * d:(i + 1) * d]
        if lin.bias is not None:
            lin.bias.data[:] = torch_mha.in_proj_bias.data[i * d:(i + 1) * d]
    module.out_linear.weight.data[:] = torch_mha.out_proj.weight.data
    if module.out_linear.bias is not None:
        module.out_linear.bias.data[:] = torch_mha.out_proj.bias.data

# %% answer="attention_layer_flops"
def attention_layer_flops(batch_size, seq_len, d_model):
    def matmul_flops(rows, inner, cols):  # one multiply and one add per term
        return 2 * rows * inner * cols

    tokens = batch_size * seq_len
    projections = sum(matmul_flops(tokens, d_model, d_model) for _ in ("q", "k", "v", "out"))
    scores = batch_size * matmul_flops(seq_len, d_model, seq_len)  # summed over heads: H * d_k = D
    weighted_values = batch_size * matmul_flops(seq_len, seq_len, d_model)
    return {"projections": projections, "attention": scores + weighted_values}

# %% answer="block_flops"
def block_flops(batch_size, seq_len, d_model, mlp_ratio=4):
    def matmul_flops(rows, inner, cols):
        return 2 * rows * inner * cols

    d_ff = int(mlp_ratio * d_model)  # the PositionwiseFeedForward's inner width
    tokens = batch_size * seq_len
    counts = attention_layer_flops(batch_size, seq_len, d_model)
    counts["mlp"] = matmul_flops(tokens, d_model, d_ff) + matmul_flops(tokens, d_ff, d_model)
    return counts

# %% answer="ANSWER_ATTENTION_CROSSOVER"
# 4·S²·D = 8·S·D² + 16·S·D²  =>  S = 6·D
ANSWER_ATTENTION_CROSSOVER = 4608

# %% answer="ANSWER_DRAFT_BUG"
ANSWER_DRAFT_BUG = "B"
