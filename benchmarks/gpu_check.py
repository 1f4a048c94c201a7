"""The course on a CUDA GPU: every solution notebook, the check tests, and notebook 06's Triton kernel natively.

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

then prints one report and writes it to ``benchmarks/results/gpu_check.json``. It exits 2 at
once, saying why, where there is no CUDA GPU, and 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
KERNEL_NOTEBOOK = "06_efficient_attention"


def cuda_missing_reason() -> str | None:
    """Why this machine cannot run the GPU check, or None when it can."""
    if torch.cuda.is_available():
        return None
    built = torch.version.cuda or "none (a CPU-only build)"
    return (f"make gpu-check needs a CUDA GPU, and there is none here: torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, CUDA in this build: {built}). Run it on a machine with an NVIDIA GPU and a CUDA "
            "build of torch (e.g. Colab with a GPU runtime).")


def _execute(path: Path, checked: bool) -> dict:
    from autograder.execute import execute_notebook

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

    from autograder import release

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


def solution_namespace() -> dict:
    """The answers of notebook 06's solution (kernel included), defined in a fresh namespace."""
    import jupytext

    notebook = jupytext.read(REPO_ROOT / "solutions" / f"{KERNEL_NOTEBOOK}.py", fmt="py:percent")
    namespace: dict = {}
    exec("import math\nimport torch\nimport torch.nn.functional as F\n"
         "from attention_lab.triton_kernels import launch_flash_attention, launch_flash_attention_backward, tl, "
         "triton", namespace)
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
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "gpu_check.json").write_text(json.dumps(report, indent=1))
    failed = (any(row["failed"] or row["errors"] for row in report.get("notebooks", []))
              or report.get("check_tests", {}).get("returncode", 0) != 0 or not report["triton_kernel"]["ok"])
    print("GPU check: " + ("FAILED" if failed else "all passed") + f" (report: {RESULTS_DIR / 'gpu_check.json'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
