"""The course's fixed contracts: the names of every notebook's answers (notebooks, checks and the
grading pipeline rely on them, so a rename must fail a test); and the solution notebooks' cells."""

from pathlib import Path

SOLUTIONS_DIR = Path(__file__).resolve().parents[1] / "solutions"


def solution_cells(assignment: str) -> list:
    """The cells of ``solutions/<assignment>.py`` as jupytext reads them (``answer=`` and ``test=``
    of a cell's header in its metadata)."""
    import jupytext

    return jupytext.read(SOLUTIONS_DIR / f"{assignment}.py", fmt="py:percent").cells


CONTRACTS: dict[str, tuple[str, ...]] = {
    "01_mha_shapes": (
        "split_heads", "merge_heads", "attention_weights", "scaled_dot_product_attention",
        "MultiHeadSelfAttention", "load_torch_mha_weights", "split_heads_einops", "attention_layer_flops",
        "block_flops",
    ),
    "02_numpy_walkthrough": (
        "row_times_matrix", "np_split_heads", "np_merge_heads", "np_softmax", "np_attention",
        "np_multi_head_attention", "dot_product_variance", "softmax_backward", "np_attention_lse",
        "np_attention_backward",
    ),
    "03_positions_and_blocks": (
        "sinusoidal_positions", "FourierFeatures", "CoordinateMLP", "psnr", "fit_image",
        "TransformerLayer", "Transformer", "pe_shift_matrix", "OrderTransformer", "previous_token_score",
        "induction_score", "induction_model",
    ),
    "04_vision_transformer": (
        "patchify", "PatchEmbedding", "conv_to_linear", "patch_embedding_parameter_count", "ViTBlock",
        "MiniViT", "cls_attention_map", "attention_rollout", "train_classifier",
    ),
    "05_llama_attention": (
        "LlamaAttentionConfig", "causal_mask", "rope_frequencies", "apply_rope", "rotate_half",
        "apply_rope_rotate_half", "rope_cos_sin", "interleave_to_half_permutation", "qk_norm",
        "repeat_kv", "LlamaAttention", "KVCache", "kv_cache_bytes",
    ),
    "06_efficient_attention": (
        "attention_matrix_bytes", "chunked_attention", "streaming_logsumexp", "online_softmax_step",
        "flash_attention_forward", "scale_kernel", "matmul_kernel", "row_softmax_kernel", "online_softmax_kernel",
        "flash_attention_kernel", "flash_attention_backward", "FlashAttention",
        "flash_attention_backward_kernel",
    ),
}
