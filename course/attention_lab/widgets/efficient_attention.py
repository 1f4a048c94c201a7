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
    """Draw the tiles of one head's score table and count how many a tiled pass computes.

    The axes keep a readable shape at any S_q / S_k (their height/width ratio follows S_q / S_k
    within [1/2, 2]); the legends sit below the tiles, never on them.
    """
    from matplotlib.patches import Patch

    states = tile_states(seq_q, seq_k, block_q, block_k, causal)
    ax = figure.add_subplot(1, 1, 1)
    # Tiles at their true edges: the last block of a ragged S is narrower than the others.
    row_edges = [min(seq_q, r * block_q) for r in range(states.shape[0] + 1)]
    col_edges = [min(seq_k, c * block_k) for c in range(states.shape[1] + 1)]
    ax.pcolormesh(col_edges, row_edges, states, cmap=TILE_COLOURS, vmin=0, vmax=2, edgecolors="white",
                  linewidth=1)
    ax.set_xlim(0, seq_k)
    ax.set_ylim(seq_q, 0)
    ax.set_box_aspect(min(2.0, max(0.5, seq_q / seq_k)))
    handles = [Patch(color=TILE_COLOURS(FULL), label="computed"),
               Patch(color=TILE_COLOURS(MASKED), label="computed, masked inside"),
               Patch(color=TILE_COLOURS(SKIPPED), label="skipped")]
    if causal:
        offset = seq_k - seq_q
        handles += ax.plot([max(0, offset), seq_k], [max(0, -offset), seq_q], color="black", linewidth=1.2,
                           label="last key each query may see")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=9,
              frameon=False)
    visited = int((states != SKIPPED).sum())
    # The title names the table and the tiles drawn, so every control visibly changes the picture
    # (at S_q = 16, block_q 64 and 128 give the same single row of tiles).
    ax.set_title(f"{visited} of {states.size} tiles computed ({int((states == MASKED).sum())} masked inside, "
                 f"{int((states == SKIPPED).sum())} skipped)\n{seq_q} × {seq_k} scores in {block_q} × {block_k} tiles"
                 + (", causal" if causal else ""), fontsize=10)
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")


# Each control gets this much room and its label in front of it (at a laptop's width with the file
# browser open, five controls in one row would leave a slider a few pixels wide): the row wraps.
CONTROL_LAYOUT = {"width": "280px", "min_width": "240px"}
CONTROL_STYLE = {"description_width": "60px"}


def block_map_explorer(seq_q: int = 256, seq_k: int = 256, block_q: int = 64, block_k: int = 64) -> LiveFigure:
    """Sliders for S_q, S_k and the block sizes; a checkbox for causal. Redraws when a slider is released."""
    common = {"layout": widgets.Layout(**CONTROL_LAYOUT), "style": CONTROL_STYLE}
    controls = {
        "seq_q": widgets.IntSlider(value=seq_q, min=16, max=1024, step=16, description="S_q",
                                   continuous_update=False, **common),
        "seq_k": widgets.IntSlider(value=seq_k, min=16, max=1024, step=16, description="S_k",
                                   continuous_update=False, **common),
        "block_q": widgets.Dropdown(options=[16, 32, 64, 128], value=block_q, description="block_q", **common),
        "block_k": widgets.Dropdown(options=[16, 32, 64, 128], value=block_k, description="block_k", **common),
        "causal": widgets.Checkbox(value=True, description="causal", indent=False,
                                   layout=widgets.Layout(width="120px")),
    }
    live = LiveFigure(plot_block_map, controls, figsize=(6.0, 5.5))
    _wrap_controls(live)
    return live


def _wrap_controls(live: LiveFigure) -> None:
    """Let the row of controls wrap onto several lines instead of squeezing them."""
    row = live.widget.children[0]
    row.layout = widgets.Layout(flex_flow="row wrap", width="100%")


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


def run_times(fn: Callable[[], object], device: torch.device, repeats: int = 3,
              stable_within: float | None = None, max_repeats: int = 30) -> list[float]:
    """Wall-clock seconds of runs of ``fn()``, after one untimed warm-up run (first calls pay for
    allocation, caches and, on a GPU, compilation and launch set-up).

    ``repeats`` runs; with ``stable_within`` (e.g. 0.05), further rounds of ``repeats`` runs until the
    median of all runs moves by at most that fraction in a round, or ``max_repeats`` runs were made."""

    def timed() -> float:
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        return time.perf_counter() - start

    fn()
    _synchronize(device)
    times = [timed() for _ in range(max(1, repeats))]
    while stable_within is not None and len(times) < max_repeats:
        before = float(np.median(times))
        times += [timed() for _ in range(min(max(1, repeats), max_repeats - len(times)))]
        if abs(float(np.median(times)) - before) <= stable_within * before:
            break
    return times


def seconds(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Median of ``repeats`` wall-clock runs, after a warm-up."""
    return float(np.median(run_times(fn, device, repeats)))


def fitted_slope(seq_lens: Sequence[int], values: Sequence[float]) -> float:
    """Slope of log(value) against log(S), least squares over the finite points: 2 means "grows like S²"."""
    pairs = [(math.log(s), math.log(v)) for s, v in zip(seq_lens, values) if v and math.isfinite(v) and v > 0]
    if len(pairs) < 2:
        return math.nan
    xs, ys = np.array(pairs).T
    return float(np.polyfit(xs, ys, 1)[0])


def attention_flops(batch_size: int, num_heads: int, seq_len: int, head_dim: int) -> int:
    """Matrix-product FLOPs of one attention call, S_q = S_k = S: q·kᵀ and P·v, 2·S²·d each (a
    multiply and an add per term); the softmax's O(S²) is small beside them."""
    return 4 * batch_size * num_heads * seq_len * seq_len * head_dim


def measure_attention_costs(functions: Mapping[str, Callable], seq_lens: Sequence[int], *, batch_size: int = 1,
                            num_heads: int = 4, head_dim: int = 64, dtype: torch.dtype = torch.float32,
                            device: torch.device | str = "cpu", repeats: int = 3, seed: int = 0,
                            progress: bool = True, cpu_threads: int | None = 1,
                            stable_within: float | None = 0.05) -> dict:
    """Time and peak memory of each ``functions[name](q, k, v)`` for each S (self-attention, S_q = S_k).

    Each time is the median of the runs after a warm-up run: rounds of ``repeats`` runs until the
    median moves by at most ``stable_within`` in a round (:func:`run_times`); ``spread`` keeps the
    fastest and slowest run. On the CPU the measurement runs on ``cpu_threads`` threads (None: as
    many as torch uses now), so that a change in the thread pool cannot bend the curves. Returns ``{"seq_lens": [...], "seconds": {name: [...]}, "spread": {name:
    [(min, max), ...]}, "bytes": {name: [...]}, "shape": (B, H, d), "device": ...}``; a function
    that fails at some S (e.g. out of memory) gets NaN there and is not run at larger S.
    """
    from tqdm.auto import tqdm

    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    results = {"seq_lens": list(seq_lens), "seconds": {n: [] for n in functions}, "bytes": {n: [] for n in functions},
               "spread": {n: [] for n in functions}, "shape": (batch_size, num_heads, head_dim),
               "device": str(device)}
    failed: set[str] = set()
    steps = tqdm(total=len(seq_lens) * len(functions), desc="measuring", disable=not progress, leave=False)
    threads = torch.get_num_threads()
    if device.type == "cpu" and cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    results["cpu_threads"] = torch.get_num_threads() if device.type == "cpu" else None
    try:
        _measure_each(functions, seq_lens, batch_size, num_heads, head_dim, dtype, device, repeats,
                      stable_within, generator, results, failed, steps)
    finally:
        torch.set_num_threads(threads)
        steps.close()
    return results


def _measure_each(functions, seq_lens, batch_size, num_heads, head_dim, dtype, device, repeats, stable_within,
                  generator, results, failed, steps) -> None:
    """The loop of :func:`measure_attention_costs`: every function at every S, into ``results``."""
    for seq_len in seq_lens:
        q, k, v = (torch.randn(batch_size, num_heads, seq_len, head_dim, generator=generator).to(device, dtype)
                   for _ in range(3))
        for name, fn in functions.items():
            steps.set_postfix_str(f"{name}, S={seq_len}")
            time_taken, memory, low, high = math.nan, math.nan, math.nan, math.nan
            if name not in failed:
                try:
                    with torch.no_grad():
                        times = run_times(lambda: fn(q, k, v), device, repeats, stable_within)
                        time_taken = float(np.median(times))
                        low, high = min(times), max(times)
                        memory = peak_bytes(lambda: fn(q, k, v), device)
                except (RuntimeError, MemoryError):  # out of memory: stop growing this one
                    failed.add(name)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            results["seconds"][name].append(time_taken)
            results["spread"][name].append((low, high))
            results["bytes"][name].append(memory)
            steps.update()


def plot_attention_costs(figure: Figure, results: Mapping, log_scale: bool = True,
                         peak_tflops: float | None = None) -> None:
    """Two panels: time against S (median, bars from the fastest to the slowest run), and peak memory of
    created tensors against S. On log-log axes each line's label gives its fitted slope (2: grows like
    S², 1: like S). ``peak_tflops``: the card's peak, to print achieved TFLOP/s against it."""
    seq_lens = results["seq_lens"]
    spread = results.get("spread", {})
    for index, (key, label, unit) in enumerate((("seconds", "time (median)", "ms"), ("bytes", "peak memory", "MiB"))):
        ax = figure.add_subplot(1, 2, index + 1)
        factor = 1e3 if unit == "ms" else 1 / 2**20
        for name, values in results[key].items():
            scaled = [value * factor for value in values]
            slope = fitted_slope(seq_lens, values)
            name_text = f"{name} (slope {slope:.1f})" if log_scale and math.isfinite(slope) else name
            if key == "seconds" and name in spread:
                low = [max(0.0, s - lo * factor) for s, (lo, _) in zip(scaled, spread[name])]
                high = [max(0.0, hi * factor - s) for s, (_, hi) in zip(scaled, spread[name])]
                ax.errorbar(seq_lens, scaled, yerr=[low, high], marker="o", capsize=3, label=name_text)
            else:
                ax.plot(seq_lens, scaled, marker="o", label=name_text)
        if log_scale:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel(f"{label} ({unit})")
        ax.set_title(label + (" — log-log" if log_scale else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=1, frameon=False)
    if peak_tflops:
        figure.text(0.5, 1.0, achieved_tflops_text(results, peak_tflops), ha="center", va="bottom", fontsize=9)
    figure.tight_layout()


def achieved_tflops_text(results: Mapping, peak_tflops: float) -> str:
    """At the largest S each function ran: attention's FLOPs / its median time, against the card's peak."""
    batch_size, num_heads, head_dim = results["shape"]
    parts = []
    for name, values in results["seconds"].items():
        done = [(s, t) for s, t in zip(results["seq_lens"], values) if math.isfinite(t)]
        if not done:
            continue
        seq_len, taken = done[-1]
        achieved = attention_flops(batch_size, num_heads, seq_len, head_dim) / taken / 1e12
        parts.append(f"{name} {achieved:.3g} ({100 * achieved / peak_tflops:.2g}%)")
    return f"achieved TFLOP/s at the largest S, of a {peak_tflops:.0f} TFLOP/s peak: " + ", ".join(parts)


def attention_costs_view(results: Mapping, peak_tflops: float | None = None) -> LiveFigure:
    """The measurements with a log/linear toggle."""
    controls = {"log_scale": widgets.Checkbox(value=True, description="log-log axes", indent=False)}
    return LiveFigure(lambda figure, log_scale: plot_attention_costs(figure, results, log_scale, peak_tflops),
                      controls, figsize=(10.0, 5.0))


# Dense float16/bfloat16 tensor-core peaks (TFLOP/s, without sparsity: half the data sheets' "with sparsity"
# figures) from the vendors' data sheets. The H100 and the H200 differ by model: the name is looked up most
# specific first ("H200 NVL" before "H200", "H100 PCIe" before "H100", the SXM card).
GPU_PEAK_TFLOPS = {"H200 NVL": 835.0, "H200": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0,
                   "A100": 312.0, "L4": 121.0, "A10": 125.0, "T4": 65.0, "V100": 125.0}


def gpu_peak_tflops(device: torch.device | str) -> float | None:
    """The card's float16 peak if its name is in :data:`GPU_PEAK_TFLOPS` (None on the CPU or unknown)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAK_TFLOPS.items() if key in name), None)


def attention_traffic(seq_len: int, head_dim: int, bytes_per_element: int = 2,
                      block_q: int = 128) -> dict[str, tuple[float, float]]:
    """``{"naive": (flops, bytes), "tiled": (flops, bytes)}`` for one head, S_q = S_k = S.

    naive: reads q, k (2·S·d), writes the scores (S²), reads them for the softmax and writes P
    (2·S²), reads P and v (S² + S·d), writes out (S·d): 4·S² + 4·S·d elements. tiled: reads q and
    writes out once (2·S·d), reads k and v once per query block (2·S·d·S/block_q); the tiles stay on
    the chip. Both do 4·S²·d FLOPs of matrix products.
    """
    flops = 4.0 * seq_len * seq_len * head_dim
    naive = (4.0 * seq_len * seq_len + 4.0 * seq_len * head_dim) * bytes_per_element
    tiled = (2.0 * seq_len * head_dim + 2.0 * seq_len * head_dim * math.ceil(seq_len / block_q)) * bytes_per_element
    return {"naive": (flops, naive), "tiled": (flops, tiled)}
