"""The checks of notebook 04 accept correct answers written differently and reject known mistakes.

Every wrong answer here is a mistake a student really makes (several are in the seed document);
each must be rejected with the hint that names it. The correct answers are deliberately written
another way than the solution notebook (F.unfold, einops, repeat instead of expand, plain Adam,
0.5·A + 0.5·I), so the checks are shown to test behaviour, not spelling.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from attention_lab import datasets
from attention_lab.checking import CheckFailure
from attention_lab.checks import vision_transformer as checks
from attention_lab.datasets import DIGITS_NUM_CLASSES, digits_loaders, load_digits_tensors
from tests.bridge_harness import run_both_ways
from tests.curriculum import solution_cells

where_checks_run = run_both_ways()

CPU = {"device": "cpu", "quiet": True}


def _rejects(check, answer, match, *args, **kwargs):
    with pytest.raises(CheckFailure, match=match):
        check(answer, *args, **{**CPU, **kwargs})


# --------------------------------------------------------------------------------------
# patchify
# --------------------------------------------------------------------------------------


def _require_divisible(images, patch_size):
    height, width = images.shape[-2:]
    if height % patch_size or width % patch_size:
        raise ValueError(f"{height}x{width} images do not split into {patch_size}x{patch_size} patches")


def patchify_unfold(images, patch_size):
    _require_divisible(images, patch_size)
    return F.unfold(images, kernel_size=patch_size, stride=patch_size).transpose(1, 2)


def patchify_einops(images, patch_size):
    _require_divisible(images, patch_size)
    return rearrange(images, "b c (h p) (w q) -> b (h w) (c p q)", p=patch_size, q=patch_size)


def patchify_channels_last(images, patch_size):
    _require_divisible(images, patch_size)
    return rearrange(images, "b c (h p) (w q) -> b (h w) (p q c)", p=patch_size, q=patch_size)


def patchify_column_major(images, patch_size):
    _require_divisible(images, patch_size)
    return rearrange(images, "b c (h p) (w q) -> b (w h) (c p q)", p=patch_size, q=patch_size)


def patchify_plain_reshape(images, patch_size):
    _require_divisible(images, patch_size)
    b, c, h, w = images.shape
    return images.reshape(b, (h // patch_size) * (w // patch_size), c * patch_size * patch_size)


def patchify_unfold_no_transpose(images, patch_size):
    _require_divisible(images, patch_size)
    return F.unfold(images, kernel_size=patch_size, stride=patch_size)


def patchify_no_error(images, patch_size):
    h, w = images.shape[-2:]
    return patchify_einops(images[..., : h - h % patch_size, : w - w % patch_size], patch_size)


def patchify_vague_error(images, patch_size):
    if images.shape[-2] % patch_size or images.shape[-1] % patch_size:
        raise ValueError("bad size")
    return patchify_einops(images, patch_size)


def patchify_float32(images, patch_size):
    return patchify_einops(images, patch_size).float()


def patchify_view(images, patch_size):
    _require_divisible(images, patch_size)
    b, c, h, w = images.shape
    blocks = images.view(b, c, h // patch_size, patch_size, w // patch_size, patch_size).permute(0, 2, 4, 1, 3, 5)
    return blocks.view(b, -1, c * patch_size * patch_size)  # fails: permuted memory


def patchify_unfold_channels_in_front(images, patch_size):
    _require_divisible(images, patch_size)
    b, c, h, w = images.shape
    grid = images.unfold(2, patch_size, patch_size).unfold(3, patch_size, patch_size)  # [B, C, h, w, P, P]
    return grid.reshape(b, (h // patch_size) * (w // patch_size), c * patch_size * patch_size)


def patchify_columns_within_patch(images, patch_size):
    _require_divisible(images, patch_size)
    return rearrange(images, "b c (h p) (w q) -> b (h w) (c q p)", p=patch_size, q=patch_size)


def test_patchify_accepts_other_correct_answers():
    checks.check_patchify(patchify_unfold, **CPU)
    checks.check_patchify(patchify_einops, seed=3, **CPU)


@pytest.mark.parametrize("answer, match", [
    (patchify_channels_last, r"\(C, P, P\) order"),
    (patchify_column_major, "row-major order"),
    (patchify_unfold_channels_in_front, "the channel axis was not moved"),
    (patchify_columns_within_patch, r"flattened column by column \(its two P axes swapped\)"),
    (patchify_plain_reshape, "cuts rows of pixels"),
    (patchify_unfold_no_transpose, r"F.unfold returns \[B, C\*P\*P, N\]"),
    (patchify_no_error, "should raise ValueError"),
    (patchify_vague_error, "should name 6 and 4"),
    (patchify_float32, "should keep the input dtype torch.float64"),
    (patchify_view, "raised RuntimeError"),
])
def test_patchify_rejects_mistakes(answer, match):
    _rejects(checks.check_patchify, answer, match)


def test_patchify_contract_messages_name_expected_and_actual():
    _rejects(checks.check_patchify, lambda images, patch_size: patchify_einops(images, patch_size)[None],
             r"should have shape \[2, 12, 12\], got \[1, 2, 12, 12\]")
    _rejects(checks.check_patchify, lambda images, patch_size: patchify_einops(images, patch_size).numpy(),
             "should be a torch.Tensor, got ndarray")
    _rejects(checks.check_patchify, lambda x, p: patchify_einops(x, p), r"should take the parameters \(images, patch_size\)")


def test_patchify_unimplemented_says_so():
    def stub(images, patch_size):
        raise NotImplementedError("Exercise 4.1: implement patchify")

    _rejects(checks.check_patchify, stub, "not implemented yet")


# --------------------------------------------------------------------------------------
# PatchEmbedding
# --------------------------------------------------------------------------------------


class PatchEmbeddingEinops(nn.Module):
    def __init__(self, img_size, patch_size, in_channels, embed_dim):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size={img_size} vs patch_size={patch_size}")
        self.num_patches = (img_size // patch_size) * (img_size // patch_size)
        self.proj = nn.Conv2d(in_channels, embed_dim, patch_size, patch_size)

    def forward(self, images):
        return rearrange(self.proj(images), "b d h w -> b (h w) d")


class PatchEmbeddingNoTranspose(PatchEmbeddingEinops):
    def forward(self, images):
        return self.proj(images).flatten(2)


class PatchEmbeddingReshape(PatchEmbeddingEinops):
    def forward(self, images):
        out = self.proj(images)
        return out.reshape(out.shape[0], -1, out.shape[1])


class PatchEmbeddingColumnMajor(PatchEmbeddingEinops):
    def forward(self, images):
        return rearrange(self.proj(images), "b d h w -> b (w h) d")


class PatchEmbeddingOtherName(nn.Module):
    def __init__(self, img_size, patch_size, in_channels, embed_dim):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.conv = nn.Conv2d(in_channels, embed_dim, patch_size, patch_size)

    def forward(self, images):
        return self.conv(images).flatten(2).transpose(1, 2)


class PatchEmbeddingOverlapping(PatchEmbeddingEinops):
    def __init__(self, img_size, patch_size, in_channels, embed_dim):
        super().__init__(img_size, patch_size, in_channels, embed_dim)
        self.proj = nn.Conv2d(in_channels, embed_dim, patch_size, stride=1)


class PatchEmbeddingFloatPatches(PatchEmbeddingEinops):
    def __init__(self, img_size, patch_size, in_channels, embed_dim):
        super().__init__(img_size, patch_size, in_channels, embed_dim)
        self.num_patches = float(self.num_patches)


class PatchEmbeddingNoError(PatchEmbeddingEinops):
    def __init__(self, img_size, patch_size, in_channels, embed_dim):
        nn.Module.__init__(self)
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, embed_dim, patch_size, patch_size)


def test_patch_embedding_accepts_other_correct_answer():
    checks.check_patch_embedding(PatchEmbeddingEinops, **CPU)


@pytest.mark.parametrize("answer, match", [
    (PatchEmbeddingNoTranspose, r"\.transpose\(1, 2\) to get tokens \[B, N, D\]"),
    (PatchEmbeddingReshape, "reshape reads memory in order"),
    (PatchEmbeddingColumnMajor, "column-major patch order"),
    (PatchEmbeddingOtherName, "attribute proj that is an nn.Conv2d"),
    (PatchEmbeddingOverlapping, "kernel_size = stride = 2"),
    (PatchEmbeddingFloatPatches, r"num_patches should be the int"),
    (PatchEmbeddingNoError, "should raise ValueError"),
])
def test_patch_embedding_rejects_mistakes(answer, match):
    _rejects(checks.check_patch_embedding, answer, match)


def test_patch_embedding_shape_message():
    _rejects(checks.check_patch_embedding, PatchEmbeddingNoTranspose, r"should have shape \[2, 16, 5\], got \[2, 5, 16\]")


# --------------------------------------------------------------------------------------
# conv_to_linear
# --------------------------------------------------------------------------------------


def conv_to_linear_clone(patch_embedding):
    conv = patch_embedding.proj
    linear = nn.Linear(conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1], conv.out_channels,
                       bias=conv.bias is not None).to(conv.weight)
    linear.weight = nn.Parameter(conv.weight.detach().flatten(1).clone())
    if conv.bias is not None:
        linear.bias = nn.Parameter(conv.bias.detach().clone())
    return linear


def conv_to_linear_from(patch_embedding, flatten):
    """conv_to_linear_clone with the weight flattened by ``flatten``."""
    linear = conv_to_linear_clone(patch_embedding)
    with torch.no_grad():
        linear.weight.copy_(flatten(patch_embedding.proj.weight))
    return linear


def conv_to_linear_channels_last(patch_embedding):
    linear = conv_to_linear_clone(patch_embedding)
    with torch.no_grad():
        linear.weight.copy_(patch_embedding.proj.weight.permute(0, 2, 3, 1).flatten(1))
    return linear


def conv_to_linear_transposed_grid(patch_embedding):
    linear = conv_to_linear_clone(patch_embedding)
    with torch.no_grad():
        linear.weight.copy_(patch_embedding.proj.weight.transpose(2, 3).flatten(1))
    return linear


def conv_to_linear_no_bias(patch_embedding):
    conv = patch_embedding.proj
    linear = nn.Linear(conv.weight[0].numel(), conv.out_channels, bias=False).to(conv.weight)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.flatten(1))
    return linear


def conv_to_linear_zero_bias(patch_embedding):
    linear = conv_to_linear_clone(patch_embedding)
    if linear.bias is not None:
        with torch.no_grad():
            linear.bias.zero_()
    return linear


def conv_to_linear_shared(patch_embedding):
    linear = conv_to_linear_clone(patch_embedding)
    linear.weight = nn.Parameter(patch_embedding.proj.weight.detach().reshape(linear.out_features, -1))
    return linear


def conv_to_linear_swapped(patch_embedding):
    conv = patch_embedding.proj
    return nn.Linear(conv.out_channels, conv.weight[0].numel()).to(conv.weight)


def conv_to_linear_float32(patch_embedding):
    return conv_to_linear_clone(patch_embedding).float()


def conv_to_linear_bias_always(patch_embedding):
    """Copies the bias whether or not the convolution has one."""
    conv = patch_embedding.proj
    linear = nn.Linear(conv.weight[0].numel(), conv.out_channels).to(conv.weight)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.reshape(conv.out_channels, -1))
        linear.bias.copy_(conv.bias)
    return linear


def conv_to_linear_bias_attribute(patch_embedding):
    """Creates the Linear without a bias when there is none, then clones the (missing) bias anyway."""
    conv = patch_embedding.proj
    linear = nn.Linear(conv.weight[0].numel(), conv.out_channels, bias=conv.bias is not None).to(conv.weight)
    linear.weight = nn.Parameter(conv.weight.detach().reshape(conv.out_channels, -1).clone())
    linear.bias = nn.Parameter(conv.bias.detach().clone())
    return linear


def test_conv_to_linear_accepts_other_correct_answer():
    checks.check_conv_to_linear(conv_to_linear_clone, **CPU)


@pytest.mark.parametrize("answer, match", [
    (conv_to_linear_channels_last, r"\(P, P, C\) order"),
    (conv_to_linear_no_bias, "the Linear has no bias"),
    (conv_to_linear_zero_bias, "copy proj.bias too"),
    (conv_to_linear_shared, "shares memory with proj.weight"),
    (conv_to_linear_swapped, r"should return nn.Linear\(12, 5\) \(C\*P\*P in, D out\), got nn.Linear\(5, 12\)"),
    (conv_to_linear_float32, "should keep the input dtype torch.float64"),
    (conv_to_linear_transposed_grid, r"two spatial axes swapped \(P_w, P_h\)"),
    (lambda patch_embedding: conv_to_linear_from(patch_embedding, lambda w: w.reshape(-1, w.shape[0]).T),
     r"each row mixes the kernels of several output channels"),
    (conv_to_linear_bias_always, r"(?s)bias=False.*raised TypeError.*this convolution has no bias \(bias=False\), "
                                 r"so proj.bias is None"),
    (conv_to_linear_bias_attribute, r"(?s)raised AttributeError.*so proj.bias is None"),
    (lambda patch_embedding: patch_embedding.proj.weight.flatten(1), r"should return an nn.Linear, got tensor of shape \[5, 12\]"),
])
def test_conv_to_linear_rejects_mistakes(answer, match):
    _rejects(checks.check_conv_to_linear, answer, match)


# --------------------------------------------------------------------------------------
# patch_embedding_parameter_count
# --------------------------------------------------------------------------------------


def test_parameter_count_accepts_other_correct_answer():
    checks.check_patch_embedding_parameter_count(lambda patch_size, in_channels, embed_dim:
                                                 (in_channels * patch_size ** 2 + 1) * embed_dim, **CPU)
    checks.check_patch_embedding_parameter_count(lambda patch_size, in_channels, embed_dim:  # a NumPy int (#52)
                                                 np.prod([in_channels, patch_size, patch_size, embed_dim]) + embed_dim,
                                                 **CPU)
    assert (3 * 16 ** 2 + 1) * 768 == 590_592  # the number the notebook quotes for ViT-B/16


@pytest.mark.parametrize("answer, match", [
    (lambda patch_size, in_channels, embed_dim: embed_dim * in_channels * patch_size ** 2, "forgot the bias"),
    (lambda patch_size, in_channels, embed_dim: embed_dim * patch_size ** 2 + embed_dim, "all C input channels"),
    (lambda patch_size, in_channels, embed_dim: in_channels * patch_size ** 2, "size of one flattened patch"),
    (lambda patch_size, in_channels, embed_dim: embed_dim * in_channels * patch_size ** 2 + in_channels,
     r"one number per \*output\* channel"),
    (lambda patch_size, in_channels, embed_dim: float(embed_dim * (in_channels * patch_size ** 2 + 1)), "should return an int"),
])
def test_parameter_count_rejects_mistakes(answer, match):
    _rejects(checks.check_patch_embedding_parameter_count, answer, match)


def test_parameter_count_message_names_expected_value():
    _rejects(checks.check_patch_embedding_parameter_count,
             lambda patch_size, in_channels, embed_dim: embed_dim * in_channels * patch_size ** 2,
             "should be 590,592, got 589824")


# --------------------------------------------------------------------------------------
# ViTBlock
# --------------------------------------------------------------------------------------


class ViTBlockAlt(nn.Module):
    """Correct, written differently: weights always computed, returned only when asked."""

    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(embed_dim, eps=1e-6)
        width = int(embed_dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, width), nn.GELU(), nn.Linear(width, embed_dim))

    def attend(self, x):
        h = self.norm1(x)
        return self.attn(query=h, key=h, value=h, need_weights=True, average_attn_weights=False)

    def forward(self, x, return_attention=False):
        update, weights = self.attend(x)
        y = x + update
        y = y + self.mlp(self.norm2(y))
        if return_attention:
            return y, weights
        return y


class ViTBlockPostNorm(ViTBlockAlt):
    def forward(self, x, return_attention=False):
        update, weights = self.attn(x, x, x, average_attn_weights=False)
        y = self.norm1(x + update)
        y = self.norm2(y + self.mlp(y))
        return (y, weights) if return_attention else y


class ViTBlockNoAttentionResidual(ViTBlockAlt):
    def forward(self, x, return_attention=False):
        update, weights = self.attend(x)
        y = update + self.mlp(self.norm2(update))
        return (y, weights) if return_attention else y


class ViTBlockNoMlpResidual(ViTBlockAlt):
    def forward(self, x, return_attention=False):
        update, weights = self.attend(x)
        y = self.mlp(self.norm2(x + update))
        return (y, weights) if return_attention else y


class ViTBlockNorm1Twice(ViTBlockAlt):
    def forward(self, x, return_attention=False):
        update, weights = self.attend(x)
        y = x + update
        y = y + self.mlp(self.norm1(y))
        return (y, weights) if return_attention else y


class ViTBlockResidualFromNormed(ViTBlockAlt):
    def forward(self, x, return_attention=False):
        update, weights = self.attend(x)
        y = self.norm1(x) + update
        y = y + self.mlp(self.norm2(y))
        return (y, weights) if return_attention else y


class ViTBlockAveragedWeights(ViTBlockAlt):
    def forward(self, x, return_attention=False):
        h = self.norm1(x)
        update, weights = self.attn(h, h, h)  # averaged over heads by default
        y = x + update
        y = y + self.mlp(self.norm2(y))
        return (y, weights) if return_attention else y


class ViTBlockNoWeights(ViTBlockAlt):
    def forward(self, x, return_attention=False):
        h = self.norm1(x)
        update, weights = self.attn(h, h, h, need_weights=False)
        y = x + update
        y = y + self.mlp(self.norm2(y))
        return (y, weights) if return_attention else y


class ViTBlockAlwaysTuple(ViTBlockAlt):
    def forward(self, x, return_attention=False):
        return super().forward(x, return_attention=True)


class ViTBlockDefaultEps(ViTBlockAlt):
    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__(embed_dim, num_heads, mlp_ratio)
        self.norm1 = nn.LayerNorm(embed_dim)


class ViTBlockRelu(ViTBlockAlt):
    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__(embed_dim, num_heads, mlp_ratio)
        self.mlp[1] = nn.ReLU()


class ViTBlockSequenceFirst(ViTBlockAlt):
    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__(embed_dim, num_heads, mlp_ratio)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads)


class ViTBlockFixedWidth(ViTBlockAlt):
    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__(embed_dim, num_heads, 4.0)


def test_vit_block_accepts_other_correct_answer():
    checks.check_vit_block(ViTBlockAlt, **CPU)
    checks.check_vit_block(ViTBlockAlt, seed=7, **CPU)


@pytest.mark.parametrize("answer, match", [
    (ViTBlockPostNorm, "post-norm block"),
    (ViTBlockNoAttentionResidual, "attention sublayer has no residual connection"),
    (ViTBlockNoMlpResidual, "MLP sublayer has no residual connection"),
    (ViTBlockNorm1Twice, "MLP reads norm2"),
    (ViTBlockResidualFromNormed, r"add attn\(norm1\(x\)\) to x itself, not to norm1\(x\)"),
    (ViTBlockAveragedWeights, "average_attn_weights=False"),
    (ViTBlockNoWeights, "need_weights=True"),
    (ViTBlockAlwaysTuple, "return only x, not a tuple"),
    (ViTBlockDefaultEps, r"eps should be 1e-6 .* got 1e-05"),
    (ViTBlockRelu, r"should be nn.GELU\(\)"),
    (ViTBlockSequenceFirst, "batch_first=True"),
    (ViTBlockFixedWidth, r"hidden width int\(embed_dim \* mlp_ratio\)"),
])
def test_vit_block_rejects_mistakes(answer, match):
    _rejects(checks.check_vit_block, answer, match)


def test_vit_block_weights_shape_message():
    _rejects(checks.check_vit_block, ViTBlockAveragedWeights, r"should have shape \[2, 4, 5, 5\], got \[2, 5, 5\]")


# --------------------------------------------------------------------------------------
# MiniViT
# --------------------------------------------------------------------------------------


class MiniViTAlt(nn.Module):
    """Correct, written differently: repeat (not expand), zeros init, the final norm on the CLS token only."""

    def __init__(self, img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.patch_embed = PatchEmbeddingEinops(img_size, patch_size, in_channels, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.blocks = nn.ModuleList(ViTBlockAlt(embed_dim, num_heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)

    def tokens(self, images):
        patches = self.patch_embed(images)
        return torch.cat([self.cls_token.repeat(len(images), 1, 1), patches], dim=1) + self.pos_embed

    def encode(self, x, return_attention):
        attentions = []
        for block in self.blocks:
            x, weights = block(x, return_attention=True)
            attentions.append(weights)
        return x, attentions

    def readout(self, x):
        return self.head(self.norm(x[:, 0]))

    def forward(self, images, return_attention=False):
        x, attentions = self.encode(self.tokens(images), return_attention)
        logits = self.readout(x)
        return (logits, attentions) if return_attention else logits


class MiniViTClsLast(MiniViTAlt):
    def tokens(self, images):
        patches = self.patch_embed(images)
        return torch.cat([patches, self.cls_token.expand(len(images), -1, -1)], dim=1) + self.pos_embed

    def readout(self, x):
        return self.head(self.norm(x[:, -1]))


class MiniViTReadsLast(MiniViTAlt):
    def readout(self, x):
        return self.head(self.norm(x[:, -1]))


class MiniViTMeanPool(MiniViTAlt):
    def readout(self, x):
        return self.head(self.norm(x).mean(dim=1))


class MiniViTPatchMeanPool(MiniViTAlt):
    def readout(self, x):
        return self.head(self.norm(x)[:, 1:].mean(dim=1))


class MiniViTReadsTokenTwo(MiniViTAlt):
    def readout(self, x):
        return self.head(self.norm(x[:, 2]))


class MiniViTPosPatchesOnly(MiniViTAlt):
    def tokens(self, images):
        patches = self.patch_embed(images) + self.pos_embed[:, 1:]
        return torch.cat([self.cls_token.expand(len(images), -1, -1), patches], dim=1)


class MiniViTPosBeforeCls(MiniViTAlt):
    def tokens(self, images):
        patches = self.patch_embed(images)
        patches = patches + self.pos_embed[:, : patches.shape[1]]  # the seed's pos_embed[:, :x.size(1)]
        return torch.cat([self.cls_token.expand(len(images), -1, -1), patches], dim=1)


class MiniViTNoPos(MiniViTAlt):
    def tokens(self, images):
        return torch.cat([self.cls_token.expand(len(images), -1, -1), self.patch_embed(images)], dim=1)


class MiniViTNoFinalNorm(MiniViTAlt):
    def readout(self, x):
        return self.head(x[:, 0])


class MiniViTShortPositions(MiniViTAlt):
    def __init__(self, img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads, mlp_ratio=4.0):
        super().__init__(img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads, mlp_ratio)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, self.pos_embed.shape[-1]))

    def tokens(self, images):
        x = torch.cat([self.cls_token.expand(len(images), -1, -1), self.patch_embed(images)], dim=1)
        return x + F.pad(self.pos_embed, (0, 0, 1, 0))


class MiniViTAveragedAttention(MiniViTAlt):
    def encode(self, x, return_attention):
        x, attentions = super().encode(x, return_attention)
        return x, [weights.mean(dim=1) for weights in attentions]


class MiniViTDetachedCls(MiniViTAlt):
    def tokens(self, images):
        patches = self.patch_embed(images)
        cls = self.cls_token.detach().expand(len(images), -1, -1)
        return torch.cat([cls, patches], dim=1) + self.pos_embed


class MiniViTSharedBlock(MiniViTAlt):
    def __init__(self, img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads, mlp_ratio=4.0):
        super().__init__(img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads, mlp_ratio)
        block = ViTBlockAlt(embed_dim, num_heads, mlp_ratio)
        self.blocks = nn.ModuleList([block] * depth)


class MiniViTPostNormBlocks(MiniViTAlt):
    def __init__(self, img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads, mlp_ratio=4.0):
        super().__init__(img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads, mlp_ratio)
        self.blocks = nn.ModuleList(ViTBlockPostNorm(embed_dim, num_heads, mlp_ratio) for _ in range(depth))


class MiniViTKeywordCalls(MiniViTAlt):
    """Correct, timm-style: the blocks are called with keywords, block(x=x) (no positional argument)."""

    def encode(self, x, return_attention):
        attentions = []
        for block in self.blocks:
            if return_attention:
                x, weights = block(x=x, return_attention=True)
                attentions.append(weights)
            else:
                x = block(x=x)
        return x, attentions


def test_mini_vit_accepts_blocks_called_by_keyword():
    """A hook that read args[0] crashed with IndexError on block(x=x)."""
    checks.check_mini_vit(MiniViTKeywordCalls, **CPU)
    checks.check_mini_vit_properties(MiniViTKeywordCalls, **CPU)


def test_mini_vit_accepts_other_correct_answer_with_repeat():
    checks.check_mini_vit(MiniViTAlt, **CPU)
    checks.check_mini_vit_properties(MiniViTAlt, **CPU)
    checks.check_mini_vit_properties(MiniViTAlt, seed=5, **CPU)


@pytest.mark.parametrize("answer, match", [
    (MiniViTClsLast, "Prepend it"),
    (MiniViTReadsLast, "the head reads the last token"),
    (MiniViTMeanPool, "the head reads the average of the tokens"),
    (MiniViTPatchMeanPool, r"the head reads the mean of the patch tokens \(global average pooling"),
    (MiniViTPosPatchesOnly, "pos_embed is added to the patch tokens only"),
    (MiniViTPosBeforeCls, "before the class token was prepended"),
    (MiniViTNoPos, "pos_embed is never added"),
    (MiniViTNoFinalNorm, "final LayerNorm"),
    (MiniViTShortPositions, "the class token has a position too"),
    (MiniViTAveragedAttention, r"per head: \[B, H, S, S\]"),
    (MiniViTSharedBlock, "independent ViTBlocks"),
    (MiniViTPostNormBlocks, "fix ViTBlock first"),
])
def test_mini_vit_rejects_mistakes(answer, match):
    _rejects(checks.check_mini_vit, answer, match)


@pytest.mark.parametrize("answer, match", [
    (MiniViTClsLast, "the class token is appended at the end. Prepend it"),
    (MiniViTReadsLast, "do not depend on token 0"),
    (MiniViTMeanPool, "depend on the patch tokens"),
    # mean pooling over the patches was told "the head reads the last token" (issue #34)
    (MiniViTPatchMeanPool, r"(?s)depend on tokens 1, 2, .*the head reads the mean of the patch tokens"),
    (MiniViTReadsTokenTwo, r"(?s)depend on token 2\..*the head must read the class token"),
    (MiniViTPosPatchesOnly, "class token did not get its position"),
    (MiniViTNoPos, "class token did not get its position"),
    (MiniViTDetachedCls, "cls_token.grad is None"),
])
def test_mini_vit_properties_reject_mistakes(answer, match):
    _rejects(checks.check_mini_vit_properties, answer, match)


def _masked_vit(mask_of):
    """A MiniViT whose blocks use an attention mask (True = blocked, nn.MultiheadAttention's convention)."""

    class MaskedBlock(ViTBlockAlt):
        def attend(self, x):
            h = self.norm1(x)
            return self.attn(h, h, h, attn_mask=mask_of(x.shape[1], x.device), need_weights=True,
                             average_attn_weights=False)

    class MaskedViT(MiniViTAlt):
        def __init__(self, img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads, mlp_ratio=4.0):
            super().__init__(img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads, mlp_ratio)
            self.blocks = nn.ModuleList(MaskedBlock(embed_dim, num_heads, mlp_ratio) for _ in range(depth))

    return MaskedViT


def test_mini_vit_properties_catch_order_dependence_without_positions():
    """Patch tokens that see only the patches after them make the model depend on patch order even with
    pos_embed zeroed: the shuffle property catches it although the blocks' inputs are right."""
    only_later = _masked_vit(lambda s, device: torch.ones(s, s, dtype=torch.bool, device=device).tril(-1))
    _rejects(checks.check_mini_vit_properties, only_later, "with pos_embed zeroed, on images whose patches were shuffled")


def test_mini_vit_properties_catch_a_class_token_that_sees_nothing():
    """With a causal mask the class token (position 0) attends only to itself: shuffling the patches
    changes nothing even with positions -- the 'and not otherwise' half of the property."""
    causal = _masked_vit(lambda s, device: torch.ones(s, s, dtype=torch.bool, device=device).triu(1))
    _rejects(checks.check_mini_vit_properties, causal, "shuffling the patches should change the logits")


def test_mini_vit_numbers_match_torch_transformer_encoder_layer():
    """The reference itself: a MiniViT built from nn.TransformerEncoderLayer equals the alternative answer."""
    torch.manual_seed(0)
    model = MiniViTAlt(8, 2, 1, 10, 16, 2, 4).double()
    images = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    logits, attentions = checks._reference_vit(model, images, 2, 4, 64)
    mine, my_attentions = model(images, return_attention=True)
    torch.testing.assert_close(logits, mine)
    for expected, got in zip(attentions, my_attentions):
        torch.testing.assert_close(expected, got)


# --------------------------------------------------------------------------------------
# ANSWER_EXPAND_REPEAT
# --------------------------------------------------------------------------------------


def test_expand_repeat_answer():
    checks.check_answer_expand_repeat("B", **CPU)
    checks.check_answer_expand_repeat(" b ", **CPU)
    _rejects(checks.check_answer_expand_repeat, "A", "still connected to the parameter in autograd's graph")
    _rejects(checks.check_answer_expand_repeat, "C", "compare the sizes of the two gradients")
    for wrong in "AC":  # a hint, not the answer: the message neither names B nor states what B says
        with pytest.raises(CheckFailure) as failure:
            checks.check_answer_expand_repeat(wrong, **CPU)
        text = str(failure.value)
        assert '"B"' not in text and "same gradient" not in text and "adds them up" not in text, text
    _rejects(checks.check_answer_expand_repeat, "D", "should be one of the strings")
    _rejects(checks.check_answer_expand_repeat, None, "not implemented yet")


def test_expand_and_repeat_really_give_the_same_gradient():
    """The fact the question rests on (the seed claims otherwise)."""
    token = nn.Parameter(torch.randn(1, 1, 4, dtype=torch.float64))
    others = torch.randn(3, 2, 4, dtype=torch.float64)
    gradients = []
    for copies in (lambda: token.expand(3, -1, -1), lambda: token.repeat(3, 1, 1)):
        token.grad = None
        torch.cat([copies(), others], dim=1).tanh().pow(2).sum().backward()
        gradients.append(token.grad.clone())
    torch.testing.assert_close(gradients[0], gradients[1])


# --------------------------------------------------------------------------------------
# train_classifier (+ outcome)
# --------------------------------------------------------------------------------------


def train_plain_adam(model, train_loader, epochs, lr, device):
    """Correct, written differently: Adam, constant lr, unweighted mean over batches, no progress bar."""
    model.to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    history = []
    for _ in range(epochs):
        batch_losses = []
        for images, labels in train_loader:
            optimizer.zero_grad(set_to_none=True)
            loss = nn.CrossEntropyLoss()(model(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            batch_losses.append(loss.item())
        history.append(sum(batch_losses) / len(batch_losses))
    return history


def train_without_train_mode(model, train_loader, epochs, lr, device):
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for images, labels in train_loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        losses.append(total / len(train_loader))
    return losses


def train_without_step(model, train_loader, epochs, lr, device):
    model.to(device).train()
    losses = []
    for _ in range(epochs):
        total = 0.0
        for images, labels in train_loader:
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            total += loss.item()
        losses.append(total / len(train_loader))
    return losses


def train_returns_tensors(model, train_loader, epochs, lr, device):
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        for images, labels in train_loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        losses.append(loss.detach())
    return losses


def train_one_batch_per_epoch(model, train_loader, epochs, lr, device):
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        images, labels = next(iter(train_loader))
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_per_step_losses(model, train_loader, epochs, lr, device):
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        for images, labels in train_loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def train_summed_loss(model, train_loader, epochs, lr, device):
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for images, labels in train_loader:
            loss = F.cross_entropy(model(images), labels, reduction="sum")
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        losses.append(total)
    return losses


def train_sgd_tiny_lr(model, train_loader, epochs, lr, device):
    model.to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr / 10)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for images, labels in train_loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        losses.append(total / len(train_loader))
    return losses


def train_without_zero_grad(model, train_loader, epochs, lr, device):
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for images, labels in train_loader:
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            total += loss.item()
        losses.append(total / len(train_loader))
    return losses


def train_model_zero_grad(model, train_loader, epochs, lr, device):
    """Correct, written differently: model.zero_grad() after the step, a generator of batches."""
    model = model.to(device)
    model.train(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    means = []
    for _ in range(epochs):
        losses = [0.0, 0]
        for images, labels in ((i.to(device), t.to(device)) for i, t in train_loader):
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            model.zero_grad()
            losses = [losses[0] + loss.item() * len(labels), losses[1] + len(labels)]
        means.append(losses[0] / losses[1])
    return means


def _loop(optimizer="adamw", bookkeeping="mean", lr_factor=1.0, evaluate_after_epoch=False):
    """A training loop with one choice varied; the defaults make a correct plain AdamW loop."""
    def train_classifier(model, train_loader, epochs, lr, device):
        model.to(device).train()
        params, rate = model.parameters(), lr * lr_factor
        optimizers = {"adamw": lambda: torch.optim.AdamW(params, lr=rate),
                      "sgd": lambda: torch.optim.SGD(params, lr=rate),
                      "sgd_momentum": lambda: torch.optim.SGD(params, lr=rate, momentum=0.9)}
        opt = optimizers[optimizer]()
        history, total, count = [], 0.0, 0
        for _ in range(epochs):
            if bookkeeping != "not_reset":
                total, count = 0.0, 0
            for images, labels in train_loader:
                loss = F.cross_entropy(model(images.to(device)), labels.to(device))
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                total, count = total + loss.item() * len(labels), count + len(labels)
            if evaluate_after_epoch:  # correct too: the loss of the whole training set after the epoch
                model.eval()
                with torch.no_grad():
                    summed = sum(F.cross_entropy(model(i.to(device)), t.to(device), reduction="sum").item()
                                 for i, t in train_loader)
                history.append(summed / len(train_loader.dataset))
                model.train()
            else:
                history.append(loss.item() if bookkeeping == "last_batch" else total / count)
        return history
    return train_classifier


def test_train_classifier_accepts_other_correct_answer():
    checks.check_train_classifier(train_model_zero_grad, **CPU)
    checks.check_train_classifier(train_plain_adam, **CPU)
    checks.check_train_classifier(_loop(), **CPU)  # gradient clipping, loss weighted per image
    checks.check_train_classifier(_loop(evaluate_after_epoch=True), **CPU)


@pytest.mark.parametrize("answer, match", [
    (_loop(bookkeeping="last_batch"), r"(?s)recomputed from what your model was given.*loss of the epoch's last "
                                      r"batch only"),
    (_loop(bookkeeping="not_reset"), "running total is not reset at the start of each epoch"),
    (_loop(optimizer="sgd"), r"(?s)not Adam or AdamW.*plain torch.optim.SGD"),
    (_loop(optimizer="sgd_momentum"), r"(?s)not Adam or AdamW.*plain torch.optim.SGD"),
])
def test_train_classifier_names_bookkeeping_and_optimizer_mistakes(answer, match):
    _rejects(checks.check_train_classifier, answer, match)


@pytest.mark.parametrize("answer, match", [
    (train_without_train_mode, r"call model.train\(\) before the training loop"),
    (train_without_step, r"call optimizer.step\(\)"),
    (train_returns_tensors, r"loss.item\(\)"),
    (train_one_batch_per_epoch, "Loop over every batch"),
    (train_per_step_losses, "should return a list of 3 floats"),
    (train_summed_loss, "mean cross-entropy per image"),
    (train_without_zero_grad, r"(?s)gradients of the previous batch were still in .grad.*call optimizer.zero_grad\(\)"),
])
def test_train_classifier_rejects_mistakes(answer, match):
    _rejects(checks.check_train_classifier, answer, match)


def test_outcome_accepts_plain_adam_loop_and_the_alternative_model(capsys):
    checks.check_train_classifier_outcome(train_plain_adam, MiniViTAlt, **CPU)
    printed = capsys.readouterr().out
    accuracy = float(printed.split("test accuracy ")[1].split("%")[0])
    assert accuracy >= 90.0, printed


def test_outcome_rejects_a_loop_that_does_not_learn():
    with pytest.raises(CheckFailure, match="barely went down") as failure:
        checks.check_train_classifier_outcome(_loop(lr_factor=1e-3), MiniViTAlt, **CPU)
    assert "It should reach at least 90%" in str(failure.value)


def test_outcome_names_the_optimizer_when_plain_sgd_does_not_learn():
    with pytest.raises(CheckFailure, match=r"(?s)It should reach at least 90%.*train_classifier fails its own check "
                                          r"\(test_train_classifier\): the first update moved each weight in "
                                          r"proportion to its gradient"):
        checks.check_train_classifier_outcome(train_sgd_tiny_lr, MiniViTAlt, **CPU)


def train_on_one_batch(model, train_loader, epochs, lr, device):
    """Fits the first batch of every epoch many times: a low training loss, a model that has seen 32 images."""
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    images, labels = next(iter(train_loader))
    losses = []
    for _ in range(epochs):
        for _ in range(10):
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    return losses


def test_outcome_names_a_loop_whose_loss_falls_but_accuracy_does_not():
    with pytest.raises(CheckFailure, match="(?s)It should reach at least 90%.*training loss went down but the test "
                                          "accuracy did not"):
        checks.check_train_classifier_outcome(train_on_one_batch, MiniViTAlt, **CPU)


def test_outcome_rejects_a_model_that_cannot_learn_positions_or_content():
    """A MiniViT whose head never sees the image cannot pass, however good the loop is."""

    class Blind(MiniViTAlt):
        def forward(self, images, return_attention=False):
            logits = self.head(self.norm(self.cls_token[:, 0].expand(len(images), -1)))
            return (logits, []) if return_attention else logits

    with pytest.raises(CheckFailure, match="It should reach at least 90%"):
        checks.check_train_classifier_outcome(train_plain_adam, Blind, **CPU)


# --------------------------------------------------------------------------------------
# pool_tokens
# --------------------------------------------------------------------------------------


def pool_timm(tokens, pool="cls"):
    """Correct, timm-style: global_pool 'avg' averages after the prefix tokens; 'token' reads token 0."""
    num_prefix_tokens = 1
    if pool == "mean":
        return tokens[:, num_prefix_tokens:].mean(dim=1)
    if pool == "cls":
        return tokens[:, 0]
    raise ValueError(f"unknown pool {pool!r}")


def pool_einsum(tokens, pool="cls"):
    """Correct, written differently: a weighting vector over the tokens and einsum."""
    if pool not in ("cls", "mean"):
        raise ValueError(f"pool must be 'cls' or 'mean', got {pool}")
    seq_len = tokens.shape[1]
    weights = torch.zeros(seq_len, dtype=tokens.dtype, device=tokens.device)
    if pool == "cls":
        weights[0] = 1.0
    else:
        weights[1:] = 1.0 / (seq_len - 1)
    return torch.einsum("bsd,s->bd", tokens, weights)


def _pool_wrong(mean, cls=lambda t: t[:, 0]):
    def pool_tokens(tokens, pool="cls"):
        if pool not in ("cls", "mean"):
            raise ValueError(pool)
        return cls(tokens) if pool == "cls" else mean(tokens)
    return pool_tokens


def test_pool_tokens_accepts_other_correct_answers():
    checks.check_pool_tokens(pool_timm, **CPU)
    checks.check_pool_tokens(pool_einsum, seed=3, **CPU)


def pool_deprecated(tokens, pool="cls", mean_of=lambda patches: patches.mean(dim=1)):
    """Right, with torch.range (deprecated: PyTorch warns on every call)."""
    if pool not in ("cls", "mean"):
        raise ValueError(pool)
    if pool == "cls":
        return tokens[:, 0]
    return mean_of(tokens.index_select(1, torch.range(1, tokens.shape[1] - 1, dtype=torch.long)))


def test_a_warning_of_a_right_answer_never_reaches_stderr_and_a_wrong_ones_follows_its_message(capsys):
    """nbgrader counts a test cell that wrote to stderr as failed (Validate, grading): a check holds the warnings
    its answer gives; it drops them when it passes, and its failure ends with them (issue #52)."""
    checks.check_pool_tokens(pool_deprecated, device="cpu")
    printed = capsys.readouterr()
    assert printed.out.startswith("✓ pool_tokens") and printed.err == "", printed
    with pytest.raises(CheckFailure) as failure:
        checks.check_pool_tokens(functools.partial(pool_deprecated, mean_of=lambda patches: patches.sum(dim=1)),
                                 **CPU)
    message = str(failure.value)
    assert message.index("Likely mistake") < message.index("Warnings while your code ran:\n    UserWarning: "
                                                           "torch.range is deprecated"), message
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("answer, match", [
    (_pool_wrong(lambda t: t.mean(dim=1)), "you included the class token"),
    (_pool_wrong(lambda t: t[:, 1:].sum(dim=1)), "do not sum them"),
    (_pool_wrong(lambda t: t[:, 1:].amax(dim=1)), "not their maximum"),
    (_pool_wrong(lambda t: t[:, 1:].mean(dim=1), cls=lambda t: t[:, -1]), "the class token is token 0"),
    (_pool_wrong(lambda t: t[:, 1:].mean(dim=1), cls=lambda t: t[:, :1]), r"an integer index drops the axis"),
    (_pool_wrong(lambda t: t[:, 1:].mean(dim=-1)), "average over the tokens"),
    (_pool_wrong(lambda t: t[:, -1]), r"pool='mean' returned the last token"),
    (_pool_wrong(lambda t: t[:, 0]), r"pool='mean' returned the class token"),
    (_pool_wrong(lambda t: t[:, 1:-1].mean(dim=1)), r"leaves out the last patch token"),
    (lambda tokens, pool="cls": tokens[:, 0] if pool == "cls" else tokens[:, 1:].mean(1), "should raise ValueError"),
])
def test_pool_tokens_rejects_mistakes(answer, match):
    _rejects(checks.check_pool_tokens, answer, match)


# --------------------------------------------------------------------------------------
# cls_attention_map
# --------------------------------------------------------------------------------------


def cls_map_einops(attention, grid_size):
    return rearrange(attention[:, :, 0, 1:], "b h (r c) -> b h r c", r=grid_size, c=grid_size)


def cls_map_column(attention, grid_size):
    return attention[:, :, 1:, 0].reshape(*attention.shape[:2], grid_size, grid_size)


def cls_map_with_cls(attention, grid_size):
    return attention[:, :, 0, :-1].reshape(*attention.shape[:2], grid_size, grid_size)


def cls_map_transposed(attention, grid_size):
    return cls_map_einops(attention, grid_size).transpose(-2, -1)


def cls_map_averaged(attention, grid_size):
    return cls_map_einops(attention, grid_size).mean(dim=1)


def cls_map_flat(attention, grid_size):
    return attention[:, :, 0, 1:]


def cls_map_view(attention, grid_size):
    return attention[:, :, 0, 1:].view(*attention.shape[:2], grid_size, grid_size)


def cls_map_in_place(attention, grid_size):
    attention[:, :, 0, 0] = 0.0
    return cls_map_einops(attention, grid_size)


def test_cls_attention_map_accepts_other_correct_answer():
    checks.check_cls_attention_map(cls_map_einops, **CPU)
    checks.check_cls_attention_map(cls_map_einops, seed=11, **CPU)
    checks.check_cls_attention_map(cls_map_view, **CPU)  # .view of the patch columns is fine: their last axis is contiguous


@pytest.mark.parametrize("answer, match", [
    (cls_map_column, "you took column 0"),
    (cls_map_with_cls, "you kept column 0"),
    (cls_map_transposed, "the grid is transposed"),
    (cls_map_averaged, "Keep every head"),
    (cls_map_flat, "reshape the N patch weights into the grid"),
    (cls_map_in_place, "modified its input in place"),
])
def test_cls_attention_map_rejects_mistakes(answer, match):
    _rejects(checks.check_cls_attention_map, answer, match)


def test_cls_attention_map_shape_message():
    _rejects(checks.check_cls_attention_map, cls_map_averaged, r"should have shape \[2, 3, 4, 4\], got \[2, 4, 4\]")


# --------------------------------------------------------------------------------------
# attention_rollout
# --------------------------------------------------------------------------------------


def rollout_half_half(attentions):
    """Correct, written differently: 0.5·A + 0.5·I (rows already sum to 1), accumulated from the last block."""
    batch, _, seq_len, _ = attentions[0].shape
    eye = torch.eye(seq_len, dtype=attentions[0].dtype, device=attentions[0].device)
    product = None
    for attention in reversed(list(attentions)):
        mixed = 0.5 * attention.mean(dim=1) + 0.5 * eye
        product = mixed if product is None else product @ mixed
    grid = int(round(math.sqrt(seq_len - 1)))
    return product[:, 0, 1:].reshape(batch, grid, grid)


def _rollout(attentions, *, reverse=False, identity=True, renormalise=True, heads="mean", blocks=None):
    batch, _, seq_len, _ = attentions[0].shape
    eye = torch.eye(seq_len, dtype=attentions[0].dtype, device=attentions[0].device)
    result = eye.expand(batch, seq_len, seq_len)
    for attention in (attentions if blocks is None else attentions[blocks]):
        mixed = {"mean": attention.mean(1), "sum": attention.sum(1), "max": attention.amax(1)}[heads]
        if identity:
            mixed = mixed + eye
        if renormalise:
            mixed = mixed / mixed.sum(-1, keepdim=True)
        result = result @ mixed if reverse else mixed @ result
    return result


def _grid(full, seq_len):
    grid = int(round(math.sqrt(seq_len - 1)))
    return full[:, 0, 1:].reshape(full.shape[0], grid, grid)


def rollout_reversed(attentions):
    return _grid(_rollout(attentions, reverse=True), attentions[0].shape[-1])


def rollout_no_identity(attentions):
    return _grid(_rollout(attentions, identity=False), attentions[0].shape[-1])


def rollout_no_renormalise(attentions):
    return _grid(_rollout(attentions, renormalise=False), attentions[0].shape[-1])


def rollout_sum_heads(attentions):
    return _grid(_rollout(attentions, heads="sum"), attentions[0].shape[-1])


def rollout_max_heads(attentions):
    return _grid(_rollout(attentions, heads="max"), attentions[0].shape[-1])


def rollout_last_only(attentions):
    return _grid(_rollout(list(attentions), blocks=slice(-1, None)), attentions[0].shape[-1])


def rollout_per_head(attentions):
    full = _rollout(attentions)
    grid = _grid(full, attentions[0].shape[-1])
    return grid[:, None].expand(-1, attentions[0].shape[1], -1, -1)


def rollout_in_place(attentions):
    eye = torch.eye(attentions[0].shape[-1], dtype=attentions[0].dtype, device=attentions[0].device)
    for attention in attentions:
        attention += eye  # modifies the caller's tensors
    return _grid(_rollout([a - eye for a in attentions]), attentions[0].shape[-1])


def rollout_vit_explain(attentions):
    """Correct, vit-explain's helper: torch.eye in float32 (its default), no dtype handling at all."""
    result = torch.eye(attentions[0].size(-1))
    with torch.no_grad():
        for attention in attentions:
            fused = attention.mean(axis=1)
            identity = torch.eye(fused.size(-1))
            a = (fused + 1.0 * identity) / 2
            a = a / a.sum(dim=-1, keepdim=True)
            result = torch.matmul(a, result)
    mask = result[:, 0, 1:]
    width = int(mask.size(-1) ** 0.5)
    return mask.reshape(-1, width, width)


def rollout_float32_inside(attentions):
    """Correct: computes in float32 (x.float()) and casts back to the input's dtype."""
    dtype = attentions[0].dtype
    a = [attention.float().mean(1) for attention in attentions]
    eye = torch.eye(a[0].shape[-1], device=a[0].device)
    rollout = eye
    for mixed in a:
        mixed = (mixed + eye) / (mixed + eye).sum(-1, keepdim=True)
        rollout = mixed @ rollout
    grid = math.isqrt(a[0].shape[-1] - 1)
    return rollout[:, 0, 1:].unflatten(-1, (grid, grid)).to(dtype)


def rollout_float32_output(attentions):
    return rollout_float32_inside(attentions).float()


def rollout_with_cls(attentions):
    full = _rollout(attentions)
    return full[:, 0, :-1].reshape(full.shape[0], *_grid(full, full.shape[-1]).shape[1:])


def rollout_column(attentions):
    full = _rollout(attentions)
    return full[:, 1:, 0].reshape(full.shape[0], *_grid(full, full.shape[-1]).shape[1:])


def rollout_transposed(attentions):
    return _grid(_rollout(attentions), attentions[0].shape[-1]).transpose(-2, -1)


def test_attention_rollout_accepts_other_correct_answer():
    checks.check_attention_rollout(rollout_half_half, **CPU)
    checks.check_attention_rollout(rollout_half_half, seed=13, **CPU)


@pytest.mark.parametrize("answer, note", [
    (rollout_vit_explain, "mixes float32 and float64 and raises"),
    (rollout_float32_inside, "accurate to float32 precision, not float64"),
    (rollout_float32_output, "returns float32"),
])
def test_attention_rollout_accepts_float32_internals_with_a_note(answer, note, capsys):
    """float64 attentions: a float32 torch.eye inside is normal (issue: vit-explain's rollout was rejected)."""
    checks.check_attention_rollout(answer, device="cpu")
    printed = capsys.readouterr().out
    assert "✓ attention_rollout" in printed and note in printed


def rollout_columns_renormalised(attentions):
    batch, _, seq_len, _ = attentions[0].shape
    eye = torch.eye(seq_len, dtype=attentions[0].dtype)
    result = eye.expand(batch, seq_len, seq_len)
    for attention in attentions:
        mixed = attention.mean(dim=1) + eye
        result = (mixed / mixed.sum(dim=-2, keepdim=True)) @ result
    grid = math.isqrt(seq_len - 1)
    return result[:, 0, 1:].reshape(batch, grid, grid)


@pytest.mark.parametrize("answer, match", [
    (rollout_reversed, "the product is in the wrong order"),
    (rollout_no_identity, "the residual connection is missing"),
    (rollout_no_renormalise, "renormalise every row"),
    (rollout_sum_heads, "do not sum them"),
    (rollout_max_heads, "the max over heads is a different method"),
    (rollout_last_only, "you used only the last block"),
    (rollout_per_head, "average the heads first"),
    (rollout_in_place, r"changed its input attentions\[0\] in place"),
    (rollout_with_cls, r"you kept column 0 \(\[CLS\] to itself\)"),
    (rollout_column, "you took column 0 of the rollout"),
    (rollout_transposed, "the grid is transposed: patch n goes to row n // grid"),
    (rollout_columns_renormalised, r"each column was renormalised"),
])
def test_attention_rollout_rejects_mistakes(answer, match):
    _rejects(checks.check_attention_rollout, answer, match)


# --------------------------------------------------------------------------------------
# The data set
# --------------------------------------------------------------------------------------


def test_digits_split_is_fixed_stratified_and_scaled():
    split = load_digits_tensors()
    again = load_digits_tensors()
    assert split.train_images.shape == (1438, 1, 8, 8) and split.test_images.shape == (359, 1, 8, 8)
    assert split.train_images.dtype == torch.float32 and split.train_labels.dtype == torch.int64
    assert float(split.train_images.min()) == 0.0 and float(split.train_images.max()) == 1.0
    assert torch.equal(split.test_images, again.test_images) and torch.equal(split.test_labels, again.test_labels)
    counts = torch.bincount(split.test_labels, minlength=DIGITS_NUM_CLASSES)
    assert int(counts.min()) >= 35 and int(counts.max()) <= 37, counts  # about 20% of each class
    other = load_digits_tensors(seed=1)
    assert not torch.equal(split.test_labels, other.test_labels) or not torch.equal(split.test_images, other.test_images)
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits_tensors(test_fraction=1.5)


def test_digits_are_what_scikit_learn_loads_whichever_way_they_are_read(monkeypatch):
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = datasets.digits_arrays()
    assert np.array_equal(images, digits.images) and np.array_equal(labels, digits.target), "the CSV read directly"
    assert labels.dtype == np.int64
    # a scikit-learn that keeps the file elsewhere: load_digits reads it
    monkeypatch.setattr(datasets, "Path", lambda *parts: Path("/nonexistent"))
    images, labels = datasets.digits_arrays()
    assert np.array_equal(images, digits.images) and np.array_equal(labels, digits.target) and labels.dtype == np.int64


def test_the_notebooks_logistic_regression_is_scikit_learns():
    """04 says its PyTorch baseline is scikit-learn's LogisticRegression() with its defaults: the same predictions."""
    from sklearn.linear_model import LogisticRegression

    cell = next(cell for cell in solution_cells("04_vision_transformer")
                if cell.cell_type == "code" and "solver.step(penalised_loss)" in cell.source)
    digits = load_digits_tensors()
    namespace = {"digits": digits, "torch": torch, "nn": nn, "F": F, "print": lambda *args: None}
    torch.manual_seed(0)
    exec(cell.source, namespace)
    reference = LogisticRegression().fit(digits.train_images.flatten(1).numpy(), digits.train_labels.numpy())
    expected = torch.from_numpy(reference.predict(digits.test_images.flatten(1).numpy()))
    assert torch.equal(namespace["baseline_predictions"], expected)
    assert round(namespace["baseline_accuracy"], 3) == 0.953  # the 95.3% the notebook quotes


def test_digits_loaders_shuffle_reproducibly():
    first, test_loader = digits_loaders(batch_size=32, seed=3)
    second, _ = digits_loaders(batch_size=32, seed=3)
    third, _ = digits_loaders(batch_size=32, seed=4)
    labels = [torch.cat([y for _, y in loader]) for loader in (first, second, third)]
    assert torch.equal(labels[0], labels[1]) and not torch.equal(labels[0], labels[2])
    images, batch_labels = next(iter(first))
    assert images.shape == (32, 1, 8, 8) and batch_labels.shape == (32,)
    assert sum(len(y) for _, y in test_loader) == 359


# --------------------------------------------------------------------------------------
# The widget
# --------------------------------------------------------------------------------------


def _explorer(num_images=5):
    from attention_lab.widgets.vit_attention import vit_attention_explorer

    torch.manual_seed(0)
    model = MiniViTAlt(8, 2, 1, 10, 16, 2, 4)
    with torch.no_grad():
        for block in model.blocks:  # sharpen attention so that heads differ visibly
            block.attn.in_proj_weight.mul_(4.0)
    split = load_digits_tensors()
    images, labels = split.test_images[:num_images], split.test_labels[:num_images]
    explorer = vit_attention_explorer(model, images, labels, cls_map_einops, rollout_half_half)
    with torch.no_grad():
        _, attentions = model(images, return_attention=True)
    return explorer, images, attentions


def _overlay_alpha(explorer):
    """The alpha channel of the tint drawn over the image: proportional to the attention grid."""
    return torch.from_numpy(explorer.figure.axes[0].images[1].get_array()[..., 3].copy())


def _grid_panel(explorer):
    return torch.from_numpy(explorer.figure.axes[1].images[0].get_array().data.copy())


def test_widget_draws_image_overlay_grid_and_colorbar():
    explorer, images, attentions = _explorer()
    axes = explorer.figure.axes
    assert len(axes) == 3  # image + tint, grid, colorbar
    assert len(axes[0].images) == 2 and axes[0].images[1].get_array().shape == (4, 4, 4)
    torch.testing.assert_close(torch.from_numpy(axes[0].images[0].get_array().data.copy()), images[0, 0].double())
    expected = cls_map_einops(attentions[-1], 4)[0].mean(0).double()  # default: last block, mean of heads
    torch.testing.assert_close(_grid_panel(explorer), expected)
    torch.testing.assert_close(_overlay_alpha(explorer), 0.75 * expected / expected.max())
    assert "true" in explorer.figure._suptitle.get_text() and "predicted" in explorer.figure._suptitle.get_text()


def test_widget_controls_change_what_is_drawn():
    explorer, images, attentions = _explorer()
    maps = [cls_map_einops(a, 4) for a in attentions]

    explorer.controls["head"].value = "head 2"
    torch.testing.assert_close(_grid_panel(explorer), maps[-1][0, 2].double())
    explorer.controls["block"].value = 0
    torch.testing.assert_close(_grid_panel(explorer), maps[0][0, 2].double())
    assert "block 1, head 2" in explorer.figure._suptitle.get_text()

    explorer.controls["image"].value = 3
    torch.testing.assert_close(_grid_panel(explorer), maps[0][3, 2].double())
    torch.testing.assert_close(torch.from_numpy(explorer.figure.axes[0].images[0].get_array().data.copy()),
                               images[3, 0].double())
    assert explorer.figure._suptitle.get_text().startswith("image 3")

    assert not explorer.controls["block"].disabled
    explorer.controls["head"].value = "rollout (all blocks)"
    torch.testing.assert_close(_grid_panel(explorer), rollout_half_half(attentions)[3].double())
    assert "rollout" in explorer.figure._suptitle.get_text()
    assert len(explorer.figure.axes) == 3  # redrawn, not stacked
    assert explorer.controls["block"].disabled  # rollout uses every block: no block to pick
    explorer.controls["head"].value = "head 1"
    assert not explorer.controls["block"].disabled


def test_widget_has_a_static_png_fallback():
    explorer, _, _ = _explorer(num_images=2)
    bundle = explorer._repr_mimebundle_()
    assert "image/png" in bundle and len(bundle["image/png"]) > 1000


def test_plot_patch_attention_rejects_a_non_square_grid():
    from matplotlib.figure import Figure

    from attention_lab.widgets.vit_attention import plot_patch_attention

    with pytest.raises(ValueError, match=r"\[grid, grid\]"):
        plot_patch_attention(Figure(), torch.zeros(1, 8, 8), torch.zeros(2, 3))


def test_training_before_a_check_is_not_mistaken_for_tampering():
    """An optimizer step imports torch._dynamo, which rebinds torch.manual_seed; the checks accept that."""
    parameter = nn.Parameter(torch.randn(3))
    optimizer = torch.optim.AdamW([parameter], lr=1e-3)
    parameter.sum().backward()
    optimizer.step()
    torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=4)
    checks.check_patch_embedding_parameter_count(lambda patch_size, in_channels, embed_dim:
                                                 embed_dim * (in_channels * patch_size ** 2 + 1), **CPU)


def test_mini_vit_failure_names_the_students_failing_vit_block():
    """MiniViT uses ViTBlock: a post-norm ViTBlock is named as the cause when MiniViT's check fails."""
    namespace = {"nn": nn, "ViTBlockBase": ViTBlockAlt, "MiniViTBase": MiniViTAlt}
    exec(  # a notebook namespace: the student's ViTBlock (wrong: post-norm) and a MiniViT built on it
        "class ViTBlock(ViTBlockBase):\n"
        "    def forward(self, x, return_attention=False):\n"
        "        update, weights = self.attend(x)\n"
        "        x = self.norm1(x + update)\n"
        "        x = self.norm2(x + self.mlp(x))\n"
        "        return (x, weights) if return_attention else x\n"
        "class MiniViT(MiniViTBase):\n"
        "    def __init__(self, img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads,\n"
        "                 mlp_ratio=4.0):\n"
        "        super().__init__(img_size, patch_size, in_channels, num_classes, embed_dim, depth, num_heads,\n"
        "                         mlp_ratio)\n"
        "        self.blocks = nn.ModuleList(ViTBlock(embed_dim, num_heads, mlp_ratio) for _ in range(depth))\n",
        namespace)
    with pytest.raises(CheckFailure, match="(?s)uses your ViTBlock, which fails its own check"):
        checks.check_mini_vit(namespace["MiniViT"], **CPU)
