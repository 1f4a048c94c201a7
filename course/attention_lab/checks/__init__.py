"""One module of checks per notebook; each test cell imports the check it calls.

* ``mha_shapes`` -- 01 Multi-head attention, shape by shape
* ``numpy_walkthrough`` -- 02 The NumPy walkthrough
* ``positions_and_blocks`` -- 03 Positions and the Transformer block
* ``vision_transformer`` -- 04 Vision Transformer from patches
* ``llama_attention`` -- 05 Llama attention: GQA, RoPE, QK-norm, KV cache
* ``efficient_attention`` -- 06 Efficient attention: from the S×S table to a FlashAttention kernel
* ``inference_attention`` -- 07 Attention at inference scale: merged states, split-K decoding, paged caches

and ``encoder_reference``, PyTorch's reference for the pre-norm Transformer block that 03 and 04 build.
"""
