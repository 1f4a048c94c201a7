"""Attention kernels on this machine, and what checking a Triton kernel in the interpreter costs.

    python -m benchmarks.attention_kernels [--seq-lens 256 512 1024 2048] [--threads N]

1. **Time and peak memory against S** for naive attention (the [S, S] table), notebook 06's
   solution ``chunked_attention`` and ``flash_attention_forward`` (PyTorch), and SDPA, on the
   CPU (B=1, H=4, d=64, float32). Peak memory is that of the tensors each call creates
   (``attention_lab.widgets.efficient_attention.peak_bytes``).
2. **The interpreter's cost per check**: each case of ``check_flash_attention_kernel`` run on
   the solution's kernel through Triton's interpreter (``TRITON_INTERPRET=1``), and the whole
   visible and hidden checks.

Results go to benchmarks/results/attention_kernels.json. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined (no GPU here)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.gpu_check import solution_namespace  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def naive_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v  # [B, H, S, S] in between


def measure_cpu(namespace: dict, seq_lens: list[int]) -> dict:
    from attention_lab.widgets.efficient_attention import measure_attention_costs

    functions = {
        "naive": naive_attention,
        "chunked (128)": lambda q, k, v: namespace["chunked_attention"](q, k, v, 128),
        "flash, PyTorch (128)": lambda q, k, v: namespace["flash_attention_forward"](q, k, v, 128, 128)[0],
        "SDPA": F.scaled_dot_product_attention,
    }
    return measure_attention_costs(functions, seq_lens, num_heads=4, head_dim=64, repeats=3, progress=False)


def interpreter_cost(namespace: dict) -> dict:
    from attention_lab.checks import efficient_attention as checks
    from attention_lab.triton_kernels import launch_flash_attention

    kernel = namespace["flash_attention_kernel"]
    cases = []
    generator = torch.Generator().manual_seed(0)
    shapes = [((1, 2, 64, 64, 16), True, 32, 32, torch.float32), ((1, 1, 45, 77, 16), False, 16, 32, torch.float32),
              ((1, 2, 48, 48, 32), True, 16, 16, torch.float16), ((1, 1, 256, 256, 16), True, 32, 32, torch.float32),
              ((4, 4, 256, 256, 64), True, 64, 64, torch.float16)]
    for (batch, heads, seq_q, seq_k, head_dim), causal, block_q, block_k, dtype in shapes:
        q = torch.randn(batch, heads, seq_q, head_dim, generator=generator).to(dtype)
        k, v = (torch.randn(batch, heads, seq_k, head_dim, generator=generator).to(dtype) for _ in range(2))
        start = time.perf_counter()
        launch_flash_attention(kernel, q, k, v, causal=causal, block_q=block_q, block_k=block_k)
        programs = -(-seq_q // block_q) * batch * heads
        cases.append({"B,H,S_q,S_k,d": [batch, heads, seq_q, seq_k, head_dim], "causal": causal,
                      "blocks": [block_q, block_k], "dtype": str(dtype).replace("torch.", ""), "programs": programs,
                      "seconds": round(time.perf_counter() - start, 3)})
    checks_seconds = {}
    for label, kwargs in (("visible check", {}), ("hidden check", {"seed": 6701, "sizes": "more"})):
        start = time.perf_counter()
        checks.check_flash_attention_kernel(kernel, device="cpu", quiet=True, **kwargs)
        checks_seconds[label] = round(time.perf_counter() - start, 2)
    for name in ("scale_kernel", "matmul_kernel", "row_softmax_kernel"):  # the warm-ups
        start = time.perf_counter()
        getattr(checks, f"check_{name}")(namespace[name], device="cpu", quiet=True)
        checks_seconds[name] = round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    checks.check_flash_attention_backward_kernel(namespace["flash_attention_backward_kernel"],
                                                 namespace["flash_attention_backward_dq_kernel"], device="cpu",
                                                 quiet=True)
    checks_seconds["backward kernels (visible check)"] = round(time.perf_counter() - start, 2)
    return {"launches": cases, "checks": checks_seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    options = parser.parse_args(argv)
    if options.threads:
        torch.set_num_threads(options.threads)
    namespace = solution_namespace()
    report = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
              "torch": torch.__version__}
    report["cpu_costs"] = measure_cpu(namespace, options.seq_lens)
    print(f"CPU ({report['machine']}), B=1, H=4, d=64, float32: time (ms) | peak memory of created tensors (MiB)")
    names = list(report["cpu_costs"]["seconds"])
    print(f"{'S':>6} " + " ".join(f"{name:>24}" for name in names))
    for index, seq_len in enumerate(report["cpu_costs"]["seq_lens"]):
        cells = [f"{report['cpu_costs']['seconds'][n][index] * 1e3:9.1f} | {report['cpu_costs']['bytes'][n][index] / 2**20:8.1f}"
                 for n in names]
        print(f"{seq_len:>6} " + " ".join(f"{cell:>24}" for cell in cells))
    report["interpreter"] = interpreter_cost(namespace)
    print("\nTriton interpreter (CPU), the solution's kernel:")
    for case in report["interpreter"]["launches"]:
        print(f"  {case['B,H,S_q,S_k,d']} causal={case['causal']} blocks={case['blocks']} {case['dtype']}: "
              f"{case['programs']} programs, {case['seconds']:.2f} s")
    for label, seconds in report["interpreter"]["checks"].items():
        print(f"  {label}: {seconds:.2f} s")
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "attention_kernels.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
