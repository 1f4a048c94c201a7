"""Isolation of the student kernel while autograding.

Every student's notebook runs in its own kernel: under bubblewrap, a fork of the grading
engine's kernel server (:func:`kernel_server_argv`, see :mod:`autograder.kernel_forkserver`),
which runs in the sandbox described below and has imported torch once; without it, a
kernel started afresh (:func:`kernel_argv`).  Either way the kernel gets:

* **resource limits** (always): address space (``--memory-mb``), size of any file it
  writes, and ``PR_SET_PDEATHSIG`` so the kernel dies with the grader;
* **bubblewrap** (where ``bwrap`` is installed and works): no network (new network
  namespace; the grader talks to the kernel over Unix sockets), no other processes (new
  PID namespace), no capabilities, a read-only view of the system, and the course
  repository, the home folder and ``/tmp`` replaced by empty folders.  Only the
  interpreter's virtual environment and the ``attention_lab`` package are visible, and the
  only writable places are the student's own working folder, a private ``/tmp`` and the
  kernel's socket folder.  The gradebook, the sources (hidden tests), ``solutions/``, git
  history and the other students' folders are not visible at all.

After each student the grading engine kills and reaps every process that student's kernels
left behind (it adopts orphans: :func:`adopt_orphans`, :func:`kill_children`; in the sandbox,
the kernel server kills every process of its PID namespace and empties its ``/tmp``), so
nothing a notebook started or left runs on into the next student's grading.

Without bubblewrap the kernel still runs under the resource limits, in a temporary course
root holding only this student's files, but it could reach the network or any file the
grader's user can reach: the grader prints a warning (see :func:`isolation_warning`).

``python -m autograder.sandbox launch --memory-mb N --file-mb M -- CMD...`` applies the
limits and ``exec``s CMD (what the kernelspec runs); ``python -m autograder.sandbox`` alone
says which isolation this machine provides.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

if not __package__:  # run as a script by the kernelspec (`python .../sandbox.py launch`)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from autograder.kernel_forkserver import COURSE_MODULES, KERNEL_MODULES, set_limits  # noqa: E402
from autograder.settings import REPO_ROOT  # noqa: E402

KERNEL_NAME = "attention-lab-grader"
KERNEL_ARGUMENTS = ["--HistoryManager.hist_file=:memory:"]  # ipykernel's, after the connection file


@functools.lru_cache(maxsize=1)
def bwrap_path() -> str | None:
    """``bwrap`` if installed and able to create the namespaces the grader uses, else None."""
    path = shutil.which("bwrap")
    if path is None:
        return None
    try:
        probe = subprocess.run(
            [path, *_bwrap_base(), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "true"],
            capture_output=True, timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if probe.returncode == 0 else None


def isolation_warning() -> str | None:
    """A warning for the instructor when the kernel cannot be sandboxed, else None."""
    if bwrap_path() is not None:
        return None
    if shutil.which("bwrap") is None:
        reason = "bubblewrap (bwrap) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    else:
        reason = "bwrap is installed but cannot create namespaces here"
    return (f"WARNING: {reason}. Student code will run WITHOUT filesystem and network isolation "
            "(memory, file-size and time limits still apply). Do not grade untrusted submissions "
            "on this machine.")


@functools.lru_cache(maxsize=1)
def package_dir() -> Path:
    """The ``attention_lab`` package this interpreter (and so a student kernel) imports.

    Found without importing it, wherever it is installed (editable from this repository, or
    not): the sandbox shows this folder, and the grader's guard trusts modules only from it.
    """
    import importlib.util

    spec = importlib.util.find_spec("attention_lab")
    if spec is None or not spec.submodule_search_locations:
        return REPO_ROOT / "course" / "attention_lab"
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def _bwrap_base() -> list[str]:
    return ["--die-with-parent", "--unshare-net", "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--cap-drop", "ALL"]


def _existing(*paths: Path) -> list[Path]:
    return [p for p in paths if p.exists()]


# What the sandbox sets for the kernel, over the environment it inherits.
SANDBOX_ENVIRONMENT = {"HOME": "/tmp", "MPLCONFIGDIR": "/tmp/matplotlib", "IPYTHONDIR": "/tmp/ipython",
                       # inside the PID namespace the kernel's parent is PID 1: no parent polling
                       "JPY_PARENT_PID": "1",
                       # the sandbox's /dev holds no GPU: Triton's kernels run in its interpreter,
                       # as the setup cell would choose -- set before anything imports Triton
                       # (the kernel server's torch._dynamo does)
                       "TRITON_INTERPRET": "1"}
KERNEL_SERVER = Path(__file__).resolve().parent / "kernel_forkserver.py"


def bwrap_arguments(workdir: Path, runtime_dir: Path, hidden: list[Path] | None = None,
                    shown: list[Path] | None = None, as_pid_1: bool = False) -> list[str]:
    """bwrap options: read-only system, repository/home/tmp hidden, ``workdir`` writable.

    ``shown``: files or folders (inside hidden trees) shown read-only as well; ``as_pid_1``:
    the command is PID 1 of the sandbox (bubblewrap installs no init of its own).
    """
    venv = Path(sys.prefix).resolve()
    interpreter = Path(sys.base_prefix).resolve()  # the venv's python may live under $HOME (pyenv)
    package = package_dir()
    home = Path.home().resolve()
    arguments = [bwrap_path() or "bwrap", *_bwrap_base(), *(["--as-pid-1"] if as_pid_1 else []),
                 "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                 "--size", str(256 * 2**20), "--tmpfs", "/tmp"]
    # Hide whole trees, then put back read-only what the kernel needs inside them.
    trees = sorted({p.resolve() for p in (home, REPO_ROOT, *(hidden or [])) if p.exists()}, key=lambda p: len(p.parts))
    covered = [Path("/tmp")]
    for folder in trees:
        if folder != Path("/") and not any(folder.is_relative_to(c) for c in covered):
            arguments += ["--tmpfs", str(folder)]  # (already-hidden trees are simply absent)
            covered.append(folder)
    for keep in _existing(interpreter, venv, package, *(shown or [])):
        arguments += ["--ro-bind", str(keep), str(keep)]
    arguments += ["--bind", str(workdir), str(workdir),
                  "--bind", str(runtime_dir), str(runtime_dir),
                  "--chdir", str(workdir)]
    for name, value in SANDBOX_ENVIRONMENT.items():
        arguments += ["--setenv", name, value]
    return [*arguments, "--"]


def kernel_python() -> str:
    """This interpreter, named through the resolved virtual environment.

    The sandbox shows the resolved environment folder (:func:`bwrap_arguments`), not a
    symbolic link to it (``.venv -> /elsewhere/venv``), which may lie in a hidden tree.  The
    last link (``bin/python`` -> the base interpreter) is kept: Python finds its virtual
    environment from the name it was started by.
    """
    return str(Path(sys.prefix).resolve() / "bin" / Path(sys.executable).name)


def kernel_argv(workdir: Path, runtime_dir: Path, *, memory_mb: int, file_mb: int,
                sandbox: bool, hidden: list[Path] | None = None) -> list[str]:
    """The kernelspec argv of a grading kernel started afresh (``{connection_file}`` filled
    in by Jupyter): without bubblewrap, or to compare with :func:`kernel_server_argv`."""
    argv = [sys.executable, str(Path(__file__).resolve()), "launch",
            f"--memory-mb={memory_mb}", f"--file-mb={file_mb}", "--"]
    if sandbox:
        argv += bwrap_arguments(workdir, runtime_dir, hidden)
    argv += [kernel_python() if sandbox else sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
             *KERNEL_ARGUMENTS]
    return argv


def kernel_server_argv(workdir_root: Path, runtime_dir: Path, hidden: list[Path] | None = None,
                       course: bool = True) -> list[str]:
    """The argv of a grading engine's kernel server (:mod:`autograder.kernel_forkserver`): in
    the sandbox, as its PID 1, with ``workdir_root`` (every kernel's working folder lies in
    it) and ``runtime_dir`` writable; ``course``: it imports torch and the course package
    once for all its kernels (notebooks that start with the course's setup cell)."""
    preload = KERNEL_MODULES + (COURSE_MODULES if course else ())
    return [*bwrap_arguments(workdir_root, runtime_dir, hidden, shown=[KERNEL_SERVER], as_pid_1=True),
            kernel_python(), str(KERNEL_SERVER), "serve", "--workdir-root", str(workdir_root),
            "--runtime-dir", str(runtime_dir), "--keep", ",".join(SANDBOX_ENVIRONMENT), "--preload", ",".join(preload)]


def kernel_client_argv(socket_path: Path, *, memory_mb: int, file_mb: int) -> list[str]:
    """The kernelspec argv of a kernel forked by the engine's kernel server (see
    :func:`kernel_server_argv`): this process lives as long as the kernel."""
    return [sys.executable, str(KERNEL_SERVER), "kernel", "--socket", str(socket_path),
            f"--memory-mb={memory_mb}", f"--file-mb={file_mb}", "-f", "{connection_file}", *KERNEL_ARGUMENTS]


def kernel_environment(threads: int = 1) -> dict[str, str]:
    """What the grading kernelspec adds to a kernel's environment."""
    return {"MPLBACKEND": "Agg", "PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}


def write_kernelspec(jupyter_dir: Path, argv: list[str], threads: int = 1) -> str:
    """Write ``<jupyter_dir>/kernels/<KERNEL_NAME>/kernel.json``; put jupyter_dir on JUPYTER_PATH."""
    spec_dir = jupyter_dir / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {"argv": argv, "display_name": "Attention Lab grader", "language": "python",
            "interrupt_mode": "message", "env": kernel_environment(threads)}
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    return KERNEL_NAME


def adopt_orphans() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``).

    A kernel that is killed leaves behind whatever it started (a process a student detached,
    or, under bubblewrap, the sandbox's own init while it tears the sandbox down): they
    become children of this process instead of the system's init, so that
    :func:`kill_children` finds them.  Returns False where the platform has no such call.
    """
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _children() -> list[int]:
    mine = str(os.getpid())
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[1] == mine:  # (comm may hold spaces)
                found.append(int(stat.parent.name))
        except (OSError, IndexError):
            continue
    return found


def kill_children(spare: int | tuple[int | None, ...] | None = None) -> list[int]:
    """SIGKILL and reap every child of this process (with :func:`adopt_orphans`: every descendant).

    Reaping a bubblewrap sandbox's init returns only once everything in the sandbox is gone.
    ``spare``: children left alone (the engine's kernel server and checker).  Returns the pids killed.
    """
    import signal

    spared = [pid for pid in (spare if isinstance(spare, tuple) else (spare,)) if pid]
    killed = list(spared)
    while children := [pid for pid in _children() if pid not in killed]:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        killed += children
    return [pid for pid in killed if pid not in spared]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    launch = sub.add_parser("launch", help="apply the resource limits, then exec the command")
    launch.add_argument("--memory-mb", type=int, default=0)
    launch.add_argument("--file-mb", type=int, default=0)
    launch.add_argument("cmd", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    if options.command == "launch":
        cmd = options.cmd[1:] if options.cmd[:1] == ["--"] else options.cmd
        set_limits(options.memory_mb, options.file_mb)
        try:
            os.execvp(cmd[0], cmd)
        except OSError as error:  # the grader reports this line as the cause (grade.start_failure_cause)
            print(f"sandbox: cannot start the kernel: {cmd[0]}: {error.strerror}", file=sys.stderr, flush=True)
            return 127
    warning = isolation_warning()
    print(warning or f"bubblewrap sandbox available: {bwrap_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
