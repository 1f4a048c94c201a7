# Correct answers in another style: transpose/reshape instead of view/permute, einsum scores.

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
