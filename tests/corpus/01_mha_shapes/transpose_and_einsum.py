# Correct answers in another style: transpose/reshape instead of view/permute, einsum scores,
# Hugging Face's eager attention (finfo.min mask, softmax in float32, cast back), state_dict loading.

# %% answer="split_heads"
def split_heads(x, num_heads):
    batch, seq, width = x.shape
    if width % num_heads:
        raise ValueError(f"D={width} is not divisible by H={num_heads}")
    return x.reshape(batch, seq, num_heads, width // num_heads).transpose(1, 2)

# %% answer="merge_heads"
def merge_heads(x):
    batch, heads, seq, d_head = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * d_head)

# %% answer="split_heads_einops"
from einops import rearrange


def split_heads_einops(x, num_heads):
    if x.shape[-1] % num_heads != 0:
        raise ValueError(f"cannot split D={x.shape[-1]} features into H={num_heads} heads")
    return rearrange(x, "b s (h d) -> b s h d", h=num_heads).transpose(1, 2)

# %% answer="attention_weights"
def attention_weights(q, k, mask=None):
    scores = torch.einsum("...qd,...kd->...qk", q, k) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    # Hugging Face's eager attention: softmax in float32, cast back to the input's dtype.
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)

# %% answer="scaled_dot_product_attention"
def scaled_dot_product_attention(q, k, v, mask=None):
    weights = attention_weights(q, k, mask=mask)
    return torch.einsum("...qk,...kd->...qd", weights, v), weights

# %% answer="MultiHeadSelfAttention"
class MultiHeadSelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.q_linear = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_linear = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_linear = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_linear = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, x, mask=None, return_weights=False):
        q, k, v = (split_heads(layer(x), num_heads=self.num_heads)
                   for layer in (self.q_linear, self.k_linear, self.v_linear))
        context, weights = scaled_dot_product_attention(q=q, k=k, v=v, mask=mask)
        out = self.out_linear(merge_heads(context))
        if return_weights:
            return out, weights
        return out

# %% answer="load_torch_mha_weights"
def load_torch_mha_weights(module, torch_mha):
    embed_dim = torch_mha.embed_dim
    layers = [module.q_linear, module.k_linear, module.v_linear]
    for index, layer in enumerate(layers):
        rows = slice(index * embed_dim, (index + 1) * embed_dim)
        block = {"weight": torch_mha.in_proj_weight[rows]}
        if torch_mha.in_proj_bias is not None:
            block["bias"] = torch_mha.in_proj_bias[rows]
        layer.load_state_dict(block)  # copies into the existing parameters
    module.out_linear.load_state_dict(torch_mha.out_proj.state_dict())

# %% answer="attention_layer_flops"
import math


def attention_layer_flops(batch_size, seq_len, d_model):
    # count the multiply-adds of each einsum from its index sizes, then 2 FLOPs each
    sizes = {"b": batch_size, "s": seq_len, "t": seq_len, "d": d_model, "e": d_model}
    macs = {
        "bsd,de->bse (x4)": 4 * math.prod(sizes[i] for i in "bsde"),
        "bsd,btd->bst": math.prod(sizes[i] for i in "bstd"),
        "bst,btd->bsd": math.prod(sizes[i] for i in "bstd"),
    }
    projections = 2 * macs["bsd,de->bse (x4)"]
    return {"projections": projections, "attention": 2 * (macs["bsd,btd->bst"] + macs["bst,btd->bsd"])}

# %% answer="block_flops"
import numpy as np


def block_flops(batch_size, seq_len, d_model, mlp_ratio=4):
    # the MLP's multiply-adds with np.prod over the einsum's index sizes: NumPy integers (np.int64), which are ints
    sizes = {"b": batch_size, "s": seq_len, "t": seq_len, "d": d_model, "e": d_model,
             "f": int(mlp_ratio * d_model)}
    macs = {"bsd,df->bsf": np.prod([sizes[i] for i in "bsdf"]), "bsf,fd->bsd": np.prod([sizes[i] for i in "bsfd"])}
    return {**attention_layer_flops(batch_size, seq_len, d_model), "mlp": 2 * sum(macs.values())}

# %% answer="ANSWER_ATTENTION_CROSSOVER"
ANSWER_ATTENTION_CROSSOVER = np.int64(6) * 768  # a NumPy integer

# %% answer="ANSWER_DRAFT_BUG"
ANSWER_DRAFT_BUG = "b"
