"""Notebook 06's views: which tiles a tiled pass visits, and what attention costs against S.

* :func:`plot_block_map` draws the grid of (query block, key block) tiles of one head:
  computed in full, computed and masked (they hold the causal diagonal), or skipped;
  :func:`block_map_explorer` wraps it with sliders for S_q, S_k and the block sizes.
* :func:`measure_attention_costs` times attention functions against the sequence length and
  records the peak memory of the tensors they create (a progress bar shows where it is);
  :func:`plot_attention_costs` draws the result; :func:`attention_costs_view` wraps it with a
  log/linear toggle.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated``; on the CPU, which keeps no such
statistic, :class:`LiveBytes` follows every tensor the function creates (a function mode) and
records the most bytes alive at once. Memory a PyTorch function allocates internally and frees
before it returns (SDPA's fused CPU kernel, softmax's temporaries) is invisible to it.
"""

from __future__ import annotations

import math
import time
import weakref
from typing import Callable, Mapping, Sequence

import ipywidgets as widgets
import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from attention_lab.widgets.live import LiveFigure

SKIPPED, MASKED, FULL = 0, 1, 2
TILE_COLOURS = ListedColormap(["#f0f0f0", "#f4a261", "#2a9d8f"])


# --------------------------------------------------------------------------------------
# Which tiles a causal pass visits
# --------------------------------------------------------------------------------------


def tile_states(seq_q: int, seq_k: int, block_q: int, block_k: int, causal: bool) -> np.ndarray:
    """``[n_q_blocks, n_k_blocks]``: SKIPPED, MASKED (visited, partly masked) or FULL for each tile.

    Query i sees key j when j <= i + (S_k - S_q) (aligned bottom-right).
    """
    offset = seq_k - seq_q
    rows, cols = math.ceil(seq_q / block_q), math.ceil(seq_k / block_k)
    states = np.full((rows, cols), FULL, dtype=int)
    if not causal:
        return states
    for r in range(rows):
        first_q, last_q = r * block_q, min(seq_q, (r + 1) * block_q) - 1
        for c in range(cols):
            first_k, last_k = c * block_k, min(seq_k, (c + 1) * block_k) - 1
            if first_k > last_q + offset:
                states[r, c] = SKIPPED
            elif last_k > first_q + offset:
                states[r, c] = MASKED
    return states


def plot_block_map(figure: Figure, seq_q: int, seq_k: int, block_q: int, block_k: int, causal: bool = True) -> None:
    """Draw the tiles of one head's score table and count how many a tiled pass computes."""
    states = tile_states(seq_q, seq_k, block_q, block_k, causal)
    ax = figure.add_subplot(1, 1, 1)
    ax.imshow(states, cmap=TILE_COLOURS, vmin=0, vmax=2, aspect="auto",
              extent=(0, seq_k, seq_q, 0), interpolation="nearest")
    for r in range(states.shape[0] + 1):
        ax.axhline(min(seq_q, r * block_q), color="white", linewidth=1)
    for c in range(states.shape[1] + 1):
        ax.axvline(min(seq_k, c * block_k), color="white", linewidth=1)
    if causal:
        offset = seq_k - seq_q
        ax.plot([max(0, offset), seq_k], [max(0, -offset), seq_q], color="black", linewidth=1.2,
                label="last key each query may see")
        ax.legend(loc="lower left", fontsize=8)
    visited = int((states != SKIPPED).sum())
    ax.set_title(f"{visited} of {states.size} tiles computed ({int((states == MASKED).sum())} masked inside, "
                 f"{int((states == SKIPPED).sum())} skipped)", fontsize=10)
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")


def block_map_explorer(seq_q: int = 256, seq_k: int = 256, block_q: int = 64, block_k: int = 64) -> LiveFigure:
    """Sliders for S_q, S_k and the block sizes; a checkbox for causal."""
    controls = {
        "seq_q": widgets.IntSlider(value=seq_q, min=16, max=1024, step=16, description="S_q"),
        "seq_k": widgets.IntSlider(value=seq_k, min=16, max=1024, step=16, description="S_k"),
        "block_q": widgets.Dropdown(options=[16, 32, 64, 128], value=block_q, description="block_q"),
        "block_k": widgets.Dropdown(options=[16, 32, 64, 128], value=block_k, description="block_k"),
        "causal": widgets.Checkbox(value=True, description="causal"),
    }
    return LiveFigure(plot_block_map, controls, figsize=(6.0, 5.0))


# --------------------------------------------------------------------------------------
# Time and peak memory against S
# --------------------------------------------------------------------------------------


class LiveBytes(TorchFunctionMode):
    """Bytes of the tensors created inside this mode that are alive; ``peak`` is the most at once.

    Every output's storage is counted once, while any tensor that uses it is alive.
    """

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._users: dict[int, int] = {}
        self._sizes: dict[int, int] = {}

    def _release(self, pointer: int) -> None:
        self._users[pointer] -= 1
        if self._users[pointer] == 0:
            self.current -= self._sizes.pop(pointer)
            del self._users[pointer]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer == 0:
                continue
            if pointer not in self._users:
                self._users[pointer] = 0
                self._sizes[pointer] = storage.nbytes()
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            self._users[pointer] += 1
            weakref.finalize(tensor, self._release, pointer)
        return out


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes of the tensors ``fn()`` creates (its inputs excluded)."""
    if device.type == "cuda":
        _synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        _synchronize(device)
        del result
        return torch.cuda.max_memory_allocated(device) - before
    tracker = LiveBytes()
    with tracker:
        result = fn()
    del result
    return tracker.peak


def seconds(fn: Callable[[], object], device: torch.device, repeats: int = 1) -> float:
    """Best of ``repeats`` wall-clock runs (after one warm-up on a GPU)."""
    if device.type == "cuda":
        fn()
    best = math.inf
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_attention_costs(functions: Mapping[str, Callable], seq_lens: Sequence[int], *, batch_size: int = 1,
                            num_heads: int = 4, head_dim: int = 64, dtype: torch.dtype = torch.float32,
                            device: torch.device | str = "cpu", repeats: int = 1, seed: int = 0,
                            progress: bool = True) -> dict:
    """Time and peak memory of each ``functions[name](q, k, v)`` for each S (self-attention, S_q = S_k).

    Returns ``{"seq_lens": [...], "seconds": {name: [...]}, "bytes": {name: [...]}}``; a function
    that fails at some S (e.g. out of memory) gets NaN there and is not run at larger S.
    """
    from tqdm.auto import tqdm

    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    results = {"seq_lens": list(seq_lens), "seconds": {n: [] for n in functions}, "bytes": {n: [] for n in functions}}
    failed: set[str] = set()
    steps = tqdm(total=len(seq_lens) * len(functions), desc="measuring", disable=not progress, leave=False)
    for seq_len in seq_lens:
        q, k, v = (torch.randn(batch_size, num_heads, seq_len, head_dim, generator=generator).to(device, dtype)
                   for _ in range(3))
        for name, fn in functions.items():
            steps.set_postfix_str(f"{name}, S={seq_len}")
            time_taken, memory = math.nan, math.nan
            if name not in failed:
                try:
                    with torch.no_grad():
                        time_taken = seconds(lambda: fn(q, k, v), device, repeats)
                        memory = peak_bytes(lambda: fn(q, k, v), device)
                except (RuntimeError, MemoryError):  # out of memory: stop growing this one
                    failed.add(name)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            results["seconds"][name].append(time_taken)
            results["bytes"][name].append(memory)
            steps.update()
    steps.close()
    return results


def plot_attention_costs(figure: Figure, results: Mapping, log_scale: bool = True) -> None:
    """Two panels: time against S, and peak memory of created tensors against S."""
    seq_lens = results["seq_lens"]
    for index, (key, label, unit) in enumerate((("seconds", "time", "ms"), ("bytes", "peak memory", "MiB"))):
        ax = figure.add_subplot(1, 2, index + 1)
        factor = 1e3 if unit == "ms" else 1 / 2**20
        for name, values in results[key].items():
            ax.plot(seq_lens, [value * factor for value in values], marker="o", label=name)
        if log_scale:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel(f"{label} ({unit})")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    figure.tight_layout()


def attention_costs_view(results: Mapping) -> LiveFigure:
    """The measurements with a log/linear toggle."""
    controls = {"log_scale": widgets.Checkbox(value=True, description="log scales")}
    return LiveFigure(lambda figure, log_scale: plot_attention_costs(figure, results, log_scale), controls,
                      figsize=(10.0, 4.0))
