"""The course on a CUDA GPU: every solution notebook, the check tests, and the Triton kernels of 06 and 07 natively.

    python -m benchmarks.gpu_check [--skip-notebooks] [--skip-tests]      (make gpu-check)

CI has no GPU, so nothing in `make test` needs one; run this wherever a GPU is lent (a
workstation, Colab, a cloud VM). It

1. runs every solution notebook top to bottom on CUDA (the checks pin TF32 off and SDPA's math
   backend, so their verdicts must be those of the CPU), hidden tests included: once as in the lab, once
   with the graded test cells in the trusted checker, as grading runs them;
2. runs the tests of the checks (``tests/test_checks_*.py``, ``tests/test_checking.py``; their whole output
   in ``benchmarks/results/gpu_check_tests.log``);
3. checks notebook 06's Triton kernels *compiled for the GPU* (not the interpreter) at small and
   larger sizes, and times the forward kernel, the two backward kernels and the two end to end
   against SDPA (forward, autograd's backward, both) over several sequence lengths with
   ``triton.testing.do_bench`` (float16, B = 4, H = 16, d = 64; 64 x 64 tiles, passed to the launchers,
   whose default is 32 x 32);
4. checks notebook 07's split-K decoding kernel compiled for the GPU, and times it (its parts merged by the
   solution's ``merge_attention_states``, as the notebook runs it) against SDPA for one query per sequence over
   1k ... 128k keys at batch 1 and 4 (float16, H_q = 32, H_kv = 8, d = 128: Llama-3-8B's attention), with
   enough splits to give the GPU's multiprocessors two programs each, and with one split (no Flash-Decoding);

then prints one report and writes it to ``benchmarks/results/gpu_check.json``. It exits 2 at
once, saying why, where there is no CUDA GPU, and 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import linecache
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
KERNEL_NOTEBOOK = "06_efficient_attention"
DECODE_NOTEBOOK = "07_inference_attention"


def cuda_missing_reason() -> str | None:
    """Why this machine cannot run the GPU check, or None when it can."""
    if torch.cuda.is_available():
        return None
    built = torch.version.cuda or "none (a CPU-only build)"
    return (f"make gpu-check needs a CUDA GPU, and there is none here: torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, CUDA in this build: {built}). Run it on a machine with an NVIDIA GPU and a CUDA "
            "build of torch (e.g. Colab with a GPU runtime).")


def _execute(path: Path, checked: bool) -> dict:
    from autograder.grading.execute import execute_notebook

    result = execute_notebook(path, checked=checked)
    return {"notebook": path.stem, "where": "grading" if checked else "lab", "seconds": round(result.seconds, 1),
            "passed": len(result.passed_tests), "failed": result.failed_tests,
            "errors": [f"{e.grade_id or e.cell_id}: {e.ename}: {e.evalue.splitlines()[0] if e.evalue else ''}"
                       for e in result.errors]}


def run_notebooks() -> list[dict]:
    """Every solution notebook on CUDA twice, each run in its own kernel, a run per core at once:
    as in the lab (the checks in the kernel, on CUDA), and as grading runs it (the graded test cells in the
    trusted checker; the kernel unsandboxed, so it has the GPU, as ``make grade SANDBOX=off`` on this machine)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from autograder.publishing import release

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        assignments = release.assignment_names()
        release.build(assignments, root / "course", root / "autograder")
        runs = [(root / "autograder" / "source" / name / f"{name}.ipynb", checked)
                for checked in (False, True) for name in assignments]
        # spawn: this process has initialised CUDA, which a forked child must not inherit
        with ProcessPoolExecutor(min(len(runs), os.cpu_count() or 1), mp_context=get_context("spawn")) as pool:
            rows = list(pool.map(_execute, *zip(*runs)))
    for row in rows:
        print(f"  {row['notebook']} ({row['where']}): {row['seconds']:.1f} s, {row['passed']} tests passed, "
              f"{len(row['failed'])} failed, {len(row['errors'])} cells raised", flush=True)
    return rows


def run_check_tests() -> dict:
    tests = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "tests").glob("test_check*.py"))
    workers = str(min(8, os.cpu_count() or 1))
    completed = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers, *tests],
                               cwd=REPO_ROOT, capture_output=True, text=True)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "gpu_check_tests.log").write_text(completed.stdout + completed.stderr)  # the failures in full
    summary = completed.stdout.strip().splitlines()[-1] if completed.stdout.strip() else completed.stderr[-500:]
    # a failed test, or a failed gate of the whole run ("hint coverage FAILED: ...", with every test passed)
    failures = [line for line in completed.stdout.splitlines()
                if line.startswith("FAILED") or line.split(":")[0].endswith(" FAILED")]
    for line in [summary, *failures]:
        print(f"  {line}", flush=True)
    return {"returncode": completed.returncode, "summary": summary, "failures": failures}


def solution_namespace(notebook_name: str = KERNEL_NOTEBOOK) -> dict:
    """The answers of a notebook's solution (its kernels included), defined in a fresh namespace."""
    import jupytext

    notebook = jupytext.read(REPO_ROOT / "solutions" / f"{notebook_name}.py", fmt="py:percent")
    namespace: dict = {}
    exec("import math\nimport torch\nimport torch.nn.functional as F\n"
         "from attention_lab.triton_kernels import launch_flash_attention, launch_flash_attention_backward, "
         "launch_split_kv_decode, tl, triton", namespace)
    for cell in notebook.cells:
        if cell.cell_type == "code" and "answer" in cell.metadata:
            # @triton.jit reads its function's source (inspect): the cell's, kept where IPython keeps a cell's
            filename = f"<{cell.metadata['answer']}>"
            linecache.cache[filename] = (len(cell.source), None, cell.source.splitlines(keepends=True), filename)
            exec(compile(cell.source, filename, "exec"), namespace)
    return namespace


def check_kernel_natively() -> dict:
    from attention_lab.checks import efficient_attention as checks
    from attention_lab.triton_kernels import TRITON_AVAILABLE, interpreter_active

    if not TRITON_AVAILABLE:
        return {"ok": False, "error": "Triton is not installed (make setup installs it on Linux)"}
    if interpreter_active():
        return {"ok": False, "error": "TRITON_INTERPRET=1 is set: unset it to compile the kernel for the GPU"}
    namespace = solution_namespace()
    backward = (namespace["flash_attention_backward_kernel"], namespace["flash_attention_backward_dq_kernel"])
    cases = [(sizes, lambda sizes=sizes: checks.check_flash_attention_kernel(
        namespace["flash_attention_kernel"], device="cuda", sizes=sizes)) for sizes in ("small", "more")]
    cases += [(f"backward kernels, {sizes}",  # the challenge: the backward pass's two kernels, compiled
               lambda sizes=sizes: checks.check_flash_attention_backward_kernel(*backward, device="cuda", sizes=sizes))
              for sizes in ("small", "more")]
    cases += [(name, lambda name=name: getattr(checks, f"check_{name}")(namespace[name], device="cuda"))
              for name in ("scale_kernel", "matmul_kernel", "row_softmax_kernel", "online_softmax_kernel")]  # warm-ups
    report: dict = {"ok": True, "checks": [], "timings_ms": []}
    for label, run_check in cases:
        try:
            run_check()
            report["checks"].append(f"{label}: passed")
        except Exception as failure:  # a failed check, or a kernel that does not compile for this GPU
            report["ok"] = False
            report["checks"].append(f"{label}: FAILED: {failure}")
    torch.backends.cuda.matmul.allow_tf32 = False
    for line in report["checks"]:
        print(f"  kernel check {line}", flush=True)
    try:
        report["timings_ms"] = time_against_sdpa(namespace, (1024, 2048, 4096, 8192, 16384))
    except Exception as failure:
        report["ok"] = False
        report["timings_error"] = f"{type(failure).__name__}: {failure}"
        print(f"  timing against SDPA FAILED: {report['timings_error']}", flush=True)
    return report


def time_against_sdpa(namespace: dict, seq_lens: tuple[int, ...]) -> list[dict]:
    """Milliseconds (``triton.testing.do_bench``'s median) of notebook 06's kernels and of SDPA, per S and
    causal: the forward pass, the backward pass (the two kernels; autograd through SDPA), and both."""
    import triton.testing

    from attention_lab.triton_kernels import launch_flash_attention, launch_flash_attention_backward

    kernels = (namespace["flash_attention_backward_kernel"], namespace["flash_attention_backward_dq_kernel"])
    tiles = {"block_q": 64, "block_k": 64}
    rows = []
    for seq_len in seq_lens:
        q, k, v, dout = (torch.randn(4, 16, seq_len, 64, device="cuda", dtype=torch.float16) for _ in range(4))
        row: dict = {"S": seq_len}
        for causal in (False, True):
            def triton_forward(causal=causal):
                return launch_flash_attention(namespace["flash_attention_kernel"], q, k, v, causal=causal, **tiles)

            out, lse = triton_forward()

            def triton_backward(causal=causal, out=out, lse=lse):
                return launch_flash_attention_backward(*kernels, q, k, v, out, lse, dout, causal=causal, **tiles)

            def triton_both(causal=causal):
                forward_out, forward_lse = triton_forward(causal)
                return launch_flash_attention_backward(*kernels, q, k, v, forward_out, forward_lse, dout,
                                                       causal=causal, **tiles)

            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

            def sdpa_forward(causal=causal):
                with torch.no_grad():
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

            sdpa_out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)

            def sdpa_backward(sdpa_out=sdpa_out):
                return torch.autograd.grad(sdpa_out, leaves, dout, retain_graph=True)

            def sdpa_both(causal=causal):
                result = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
                return torch.autograd.grad(result, leaves, dout)

            timings = {}
            for name, fn in (("forward", (triton_forward, sdpa_forward)), ("backward", (triton_backward, sdpa_backward)),
                             ("forward+backward", (triton_both, sdpa_both))):
                triton_ms, sdpa_ms = (triton.testing.do_bench(f) for f in fn)
                timings[name] = {"triton": round(triton_ms, 3), "sdpa": round(sdpa_ms, 3),
                                 "triton/sdpa": round(triton_ms / sdpa_ms, 2)}
            row["causal" if causal else "full"] = timings
            del sdpa_out
        rows.append(row)
        print(f"  S={seq_len}: " + "; ".join(
            f"{mask} {name} {t['triton']} ms vs SDPA {t['sdpa']} ms"
            for mask in ("full", "causal") for name, t in row[mask].items()), flush=True)
    return rows


def check_decode_kernel_natively() -> dict:
    """Notebook 07's split-K decoding kernel compiled for the GPU: its check (small and larger sizes), then its time
    against SDPA for one query per sequence."""
    from attention_lab.checks import inference_attention as checks
    from attention_lab.triton_kernels import TRITON_AVAILABLE, interpreter_active

    if not TRITON_AVAILABLE:
        return {"ok": False, "error": "Triton is not installed (make setup installs it on Linux)"}
    if interpreter_active():
        return {"ok": False, "error": "TRITON_INTERPRET=1 is set: unset it to compile the kernel for the GPU"}
    namespace = solution_namespace(DECODE_NOTEBOOK)
    report: dict = {"ok": True, "checks": [], "timings_ms": []}
    for sizes in ("small", "more"):
        try:
            checks.check_split_kv_decode_kernel(namespace["split_kv_decode_kernel"], device="cuda", sizes=sizes)
            report["checks"].append(f"split_kv_decode_kernel, {sizes}: passed")
        except Exception as failure:
            report["ok"] = False
            report["checks"].append(f"split_kv_decode_kernel, {sizes}: FAILED: {failure}")
    for line in report["checks"]:
        print(f"  kernel check {line}", flush=True)
    try:
        report["timings_ms"] = time_decode_against_sdpa(namespace, DECODE_SEQ_LENS, batches=(1, 4),
                                                        device=torch.device("cuda"))
    except Exception as failure:
        report["ok"] = False
        report["timings_error"] = f"{type(failure).__name__}: {failure}"
        print(f"  timing against SDPA FAILED: {report['timings_error']}", flush=True)
    return report


DECODE_SEQ_LENS = (1024, 4096, 16384, 65536, 131072)
# Llama-3-8B's attention: 32 query heads, 8 KV heads of 128
DECODE_SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 128, "block": 64}


def decode_splits(batch: int, heads: int, seq_len: int, block: int, programs: int) -> int:
    """Splits that give the GPU about ``programs`` programs (two per multiprocessor), each at least a tile of keys:
    Flash-Decoding's rule of thumb."""
    return max(1, min(math.ceil(programs / (batch * heads)), math.ceil(seq_len / block)))


def time_decode_against_sdpa(namespace: dict, seq_lens: Sequence[int], batches: Sequence[int], device: torch.device,
                             shape: dict | None = None, timer: Callable[[Callable], float] | None = None,
                             dtype: torch.dtype = torch.float16, programs: int | None = None) -> list[dict]:
    """Milliseconds of notebook 07's ``split_kv_decode_kernel`` (its parts merged by ``merge_attention_states``)
    with Flash-Decoding's splits and with one split, and of SDPA (``enable_gqa``), for one query per sequence over
    each number of keys and batch. ``timer(fn) -> ms``: ``triton.testing.do_bench`` by default (a GPU's); a CPU
    dry run passes a plain clock (Triton's interpreter runs the kernel there). ``programs``: how many programs the
    splits aim at (default: two per multiprocessor of the GPU)."""
    from attention_lab.triton_kernels import launch_split_kv_decode

    shape = dict(DECODE_SHAPE if shape is None else shape)
    if timer is None:
        import triton.testing

        timer = triton.testing.do_bench
    if programs is None:
        programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    kernel, merge = namespace["split_kv_decode_kernel"], namespace["merge_attention_states"]
    heads, kv_heads, head_dim, block = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["block"]
    rows = []
    for batch in batches:
        for seq_len in seq_lens:
            q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
            k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, device=device, dtype=dtype) for _ in range(2))
            splits = decode_splits(batch, heads, seq_len, block, programs)

            def decode(num_splits: int, q=q, k=k, v=v) -> Callable:
                return lambda: launch_split_kv_decode(kernel, q, k, v, num_splits, block=block, merge=merge)

            def sdpa(q=q, k=k, v=v) -> torch.Tensor:
                with torch.no_grad():
                    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)

            reference = sdpa()[:, :, 0].float()
            difference = float((decode(splits)()[0].float() - reference).abs().max())
            split_ms, single_ms, sdpa_ms = timer(decode(splits)), timer(decode(1)), timer(sdpa)
            row = {"B": batch, "L": seq_len, "splits": splits, "split_k_ms": round(split_ms, 4),
                   "one_split_ms": round(single_ms, 4), "sdpa_ms": round(sdpa_ms, 4),
                   "split_k/sdpa": round(split_ms / sdpa_ms, 2), "one_split/split_k": round(single_ms / split_ms, 2),
                   "max_difference": difference}
            rows.append(row)
            print(f"  B={batch} L={seq_len}: split-K ({splits} splits) {row['split_k_ms']} ms, one split "
                  f"{row['one_split_ms']} ms, SDPA {row['sdpa_ms']} ms (split-K/SDPA {row['split_k/sdpa']}, "
                  f"difference from SDPA {difference:.1e})", flush=True)
            del q, k, v
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-notebooks", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    options = parser.parse_args(argv)
    reason = cuda_missing_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    os.environ.pop("ATTENTION_LAB_DEVICE", None)  # the notebooks pick CUDA
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    print(f"GPU check on {report['device']} (torch {torch.__version__})", flush=True)
    if not options.skip_notebooks:
        print("solution notebooks on CUDA:", flush=True)
        report["notebooks"] = run_notebooks()
    if not options.skip_tests:
        print("tests of the checks:", flush=True)
        report["check_tests"] = run_check_tests()
    print("notebook 06's Triton kernel, compiled for the GPU:", flush=True)
    report["triton_kernel"] = check_kernel_natively()
    print("notebook 07's split-K decoding kernel, compiled for the GPU:", flush=True)
    report["decode_kernel"] = check_decode_kernel_natively()
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "gpu_check.json").write_text(json.dumps(report, indent=1))
    failed = (any(row["failed"] or row["errors"] for row in report.get("notebooks", []))
              or report.get("check_tests", {}).get("returncode", 0) != 0 or not report["triton_kernel"]["ok"]
              or not report["decode_kernel"]["ok"])
    print("GPU check: " + ("FAILED" if failed else "all passed") + f" (report: {RESULTS_DIR / 'gpu_check.json'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
