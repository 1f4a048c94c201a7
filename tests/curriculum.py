"""The course's fixed contracts: the names of every notebook's answers (notebooks, checks and the
grading pipeline rely on them, so a rename must fail a test); and the solution notebooks' cells."""

from pathlib import Path

SOLUTIONS_DIR = Path(__file__).resolve().parents[1] / "solutions"


def solution_cells(assignment: str) -> list:
    """The cells of ``solutions/<assignment>.py`` as jupytext reads them (``answer=`` and ``test=``
    of a cell's header in its metadata)."""
    import jupytext

    return jupytext.read(SOLUTIONS_DIR / f"{assignment}.py", fmt="py:percent").cells


def long_code_lines(assignment: str, limit: int = 100) -> list[tuple[int, str]]:
    """(cell index, line) of every code line of the solution notebook longer than ``limit`` characters."""
    return [(index, line) for index, cell in enumerate(solution_cells(assignment)) if cell.cell_type == "code"
            for line in cell.source.splitlines() if len(line) > limit]


def demos_before_their_check(assignment: str) -> list[str]:
    """Code cells that call an answer between its answer cell and its first test cell: a demo a student's wrong
    answer would crash before the check could say what is wrong."""
    cells = solution_cells(assignment)
    early = []
    for index, cell in enumerate(cells):
        name = cell.metadata.get("answer")
        if not name:
            continue
        test = next(i for i in range(index, len(cells)) if cells[i].metadata.get("test", "").startswith(f"test_{name}"))
        early += [f"{name}: {cells[i].source[:60]}" for i in range(index + 1, test)
                  if cells[i].cell_type == "code" and f"{name}(" in cells[i].source]
    return early


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
    "07_inference_attention": (
        "merge_attention_states", "split_kv_decode", "split_kv_decode_kernel", "slot_mapping", "PagedKVCache",
        "paged_decode_attention", "sliding_window_mask", "attention_with_sinks", "streaming_kept_positions",
        "streaming_decode", "mla_cache_entry", "mla_attention_naive", "mla_attention_absorbed", "mla_cache_bytes",
        "tree_attention_mask", "tree_position_ids",
    ),
}
