"""Isolation of the student kernel while autograding.

Every student's notebook runs in its own kernel: under bubblewrap, a fork of the nbgrader
process's kernel server (:func:`kernel_server_argv`, see :mod:`autograder.isolation.kernel_forkserver`),
which runs in the sandbox described below and has imported torch once; without it (only
when the instructor says ``--sandbox off``), a kernel started afresh (:func:`kernel_argv`).
Either way the kernel gets:

* **its environment from an allow-list** (:func:`kernel_environ`): locale, time zone, the
  course's own switches and what the grading kernelspec sets; never the grader's variables
  (``ATTENTION_LAB_DB_URL`` and its password, tokens, paths);
* **resource limits** per process: address space (``--memory-mb``), size of any file it
  writes, no core dumps, and ``PR_SET_PDEATHSIG`` so the kernel dies with the grader;
* **bubblewrap**: no network (new network namespace; the grader talks to the kernel over
  Unix sockets), no other processes (new PID namespace), no capabilities, and a file system
  made of an allow-list (:func:`bwrap_arguments`): read-only, the system's programs and
  libraries (``/usr`` and its links ``/bin``, ``/lib``...; from ``/etc`` only the dynamic
  linker's cache and the time zone; the CPU list under ``/sys``), the Python interpreter,
  the virtual environment and the ``attention_lab`` package; writable, the kernels' working
  folders and their socket folder, and a private ``/tmp`` (also ``HOME`` and
  ``IPYTHONDIR``) and ``/dev/shm``, tmpfs of ``--disk-mb`` each; a fresh ``/dev`` and
  ``/proc``, and an IPC namespace of its own (its POSIX message queues in ``/dev/mqueue``).
  Nothing else of the machine exists in it: the gradebook, the sources (hidden tests),
  ``solutions/``, other checkouts, home folders, the other students' files;
* **limits for the sandbox as a whole** where the machine offers a control group
  (:mod:`autograder.isolation.cgroups`): memory of all its processes together, their number; the
  grader also holds every submission to a wall-clock and CPU budget over all its attempts
  and a disk quota on the writable folders that the host backs (:mod:`autograder.grading.task`).

After each kernel the kernel server kills every process that kernel left, empties
``/tmp`` and ``/dev/shm`` (read-only folders a student made included) and removes every
System V and POSIX IPC object: every kernel starts on a fresh writable file system and an
empty IPC namespace.  After each student the nbgrader process kills and reaps
every process that student's kernels left behind (it adopts orphans: :func:`adopt_orphans`,
:func:`kill_children`).

Without a working bubblewrap, grading refuses to start (:func:`unavailable_reason` says
why), unless the instructor turns the sandbox off explicitly (``make grade SANDBOX=off``):
then the kernel runs under the per-process limits only, in a temporary course root holding
only this student's files, and could reach the network or any file the grader's user can.

``python -m autograder.isolation.sandbox launch [--cgroup FILE ...] --memory-mb N --file-mb M -- CMD...``
joins the control group, applies the limits, keeps the allowed environment and ``exec``s CMD
(what the kernelspec runs); ``python -m autograder.isolation.sandbox`` alone says which isolation and
which limits this machine provides.
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

import psutil

if not __package__:  # run as a script by the kernelspec (`python .../sandbox.py launch`)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from autograder.command_line import command_line  # noqa: E402
from autograder.isolation import cgroups  # noqa: E402
from autograder.isolation.kernel_forkserver import COURSE_MODULES, KERNEL_MODULES, POSIX_QUEUES, set_limits  # noqa: E402
from autograder.limits import Limits  # noqa: E402
from autograder.places import REPO_ROOT  # noqa: E402

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
            [path, *_bwrap_base(), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--mqueue", POSIX_QUEUES,
             "true"],
            capture_output=True, timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if probe.returncode == 0 else None


def unavailable_reason() -> str | None:
    """Why student code cannot be sandboxed on this machine, else None."""
    if bwrap_path() is not None:
        return None
    if shutil.which("bwrap") is None:
        return ("bubblewrap (bwrap) is not installed: `make sandbox` installs it (Debian/Ubuntu, as root; or "
                "`sudo apt-get install bubblewrap`); grading itself installs nothing")
    return "bwrap is installed but cannot create namespaces here (unprivileged user namespaces disabled?)"


def refusal() -> str:
    """What ``make grade`` says when it refuses to grade without the sandbox."""
    return (f"refusing to grade: {unavailable_reason()}. Without the sandbox, student code runs with "
            "no filesystem or network isolation, as your user. To grade WITHOUT isolation on purpose "
            "(trusted submissions only): make grade SANDBOX=off "
            "(python -m autograder.grading.grade --sandbox off).")


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


# What of the system a kernel sees (read-only): the programs and libraries, the links to them
# (merged /usr: /bin -> usr/bin), the dynamic linker's cache, the time zone, the CPU list
# (torch reads it to size its thread pools).  Nothing else of /etc: no users, hosts or keys.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
                "/sys/devices/system/cpu")
# Size of the sandbox's /tmp (also HOME and IPYTHONDIR) and of its /dev/shm, each (tmpfs).
DISK_MB = Limits.disk_mb

# What the sandbox sets for the kernel, over the environment it inherits.
SANDBOX_ENVIRONMENT = {"HOME": "/tmp", "MPLCONFIGDIR": "/tmp/matplotlib", "IPYTHONDIR": "/tmp/ipython",
                       # no user database in the sandbox: who getpass.getuser() says the kernel is
                       "USER": "student", "LOGNAME": "student",
                       # inside the PID namespace the kernel's parent is PID 1: no parent polling
                       "JPY_PARENT_PID": "1",
                       # the sandbox's /dev holds no GPU: Triton's kernels run in its interpreter,
                       # as the setup cell would choose -- set before anything imports Triton
                       # (the kernel server's torch._dynamo does)
                       "TRITON_INTERPRET": "1"}
KERNEL_SERVER = Path(__file__).resolve().parent / "kernel_forkserver.py"


def _system_arguments() -> list[str]:
    arguments = []
    for name in SYSTEM_PATHS:
        path = Path(name)
        if path.is_symlink():
            arguments += ["--symlink", os.readlink(path), name]
        elif path.exists():
            arguments += ["--ro-bind", name, name]
    return arguments


def bwrap_arguments(workdir: Path, runtime_dir: Path, hidden: list[Path] | None = None,
                    shown: list[Path] | None = None, as_pid_1: bool = False, disk_mb: int = DISK_MB) -> list[str]:
    """bwrap options: a file system of the system's programs and libraries, the interpreter,
    the virtual environment and the course package, read-only; ``workdir`` and
    ``runtime_dir`` writable; a fresh ``/tmp`` and ``/dev/shm`` of ``disk_mb`` each.

    ``shown``: files or folders shown read-only as well; ``hidden``: folders emptied where
    they lie inside a shown one; ``as_pid_1``: the command is PID 1 of the sandbox
    (bubblewrap installs no init of its own).
    """
    venv = Path(sys.prefix).resolve()
    interpreter = Path(sys.base_prefix).resolve()  # the venv's python may live under $HOME (pyenv)
    size = str(disk_mb * 2**20)
    arguments = [bwrap_path() or "bwrap", *_bwrap_base(), *(["--as-pid-1"] if as_pid_1 else []),
                 *_system_arguments(), "--dev", "/dev", "--proc", "/proc", "--mqueue", POSIX_QUEUES,
                 "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/dev/shm"]
    shown_paths = [p for p in (interpreter, venv, package_dir(), *(Path(s).resolve() for s in shown or []))
                   if p.exists()]
    for keep in shown_paths:
        arguments += ["--ro-bind", str(keep), str(keep)]
    for folder in sorted({Path(h).resolve() for h in hidden or []}, key=lambda p: len(p.parts)):
        if any(folder.is_relative_to(keep) for keep in shown_paths if keep.is_dir()):
            arguments += ["--tmpfs", str(folder)]
    arguments += ["--bind", str(workdir), str(workdir),
                  "--bind", str(runtime_dir), str(runtime_dir),
                  "--chdir", str(workdir)]
    for name, value in {**SANDBOX_ENVIRONMENT, "PATH": kernel_path()}.items():
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


def _launch(memory_mb: int, file_mb: int, cgroup: list[str] | None = None) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "launch", *(f"--cgroup={f}" for f in cgroup or []),
            f"--memory-mb={memory_mb}", f"--file-mb={file_mb}", "--"]


def kernel_argv(workdir: Path, runtime_dir: Path, *, memory_mb: int, file_mb: int,
                sandbox: bool, hidden: list[Path] | None = None, disk_mb: int = DISK_MB) -> list[str]:
    """The kernelspec argv of a grading kernel started afresh (``{connection_file}`` filled
    in by Jupyter): without bubblewrap, or to compare with :func:`kernel_server_argv`."""
    argv = _launch(memory_mb, file_mb)
    if sandbox:
        argv += bwrap_arguments(workdir, runtime_dir, hidden, disk_mb=disk_mb)
    argv += [kernel_python() if sandbox else sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
             *KERNEL_ARGUMENTS]
    return argv


def kernel_server_argv(workdir_root: Path, runtime_dir: Path, hidden: list[Path] | None = None,
                       course: bool = True, disk_mb: int = DISK_MB, cgroup: list[str] | None = None) -> list[str]:
    """The argv of a nbgrader process's kernel server (:mod:`autograder.isolation.kernel_forkserver`): in
    the sandbox, as its PID 1, with ``workdir_root`` (every kernel's working folder lies in
    it) and ``runtime_dir`` writable; ``course``: it imports torch and the course package
    once for all its kernels (notebooks that start with the course's setup cell); ``cgroup``:
    the sandbox's control group (:attr:`autograder.isolation.cgroups.Group.procs_files`), joined first."""
    preload = KERNEL_MODULES + (COURSE_MODULES if course else ())
    return [*(_launch(0, 0, cgroup) if cgroup else []),
            *bwrap_arguments(workdir_root, runtime_dir, hidden, shown=[KERNEL_SERVER], as_pid_1=True, disk_mb=disk_mb),
            kernel_python(), str(KERNEL_SERVER), "serve", "--workdir-root", str(workdir_root),
            "--runtime-dir", str(runtime_dir), "--keep", ",".join([*SANDBOX_ENVIRONMENT, "PATH"]),
            "--allow", ",".join(INHERITED_ENVIRONMENT + tuple(kernel_environment())), "--preload", ",".join(preload)]


def kernel_client_argv(socket_path: Path, *, memory_mb: int, file_mb: int) -> list[str]:
    """The kernelspec argv of a kernel forked by the nbgrader process's kernel server (see
    :func:`kernel_server_argv`): this process lives as long as the kernel."""
    return [sys.executable, str(KERNEL_SERVER), "kernel", "--socket", str(socket_path),
            f"--memory-mb={memory_mb}", f"--file-mb={file_mb}", "-f", "{connection_file}", *KERNEL_ARGUMENTS]


def kernel_environment(threads: int = 1) -> dict[str, str]:
    """What the grading kernelspec adds to a kernel's environment."""
    return {"MPLBACKEND": "Agg", "PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}


# The variables a kernel keeps from the environment it is started with, besides those of
# :func:`kernel_environment` and :data:`SANDBOX_ENVIRONMENT` (and ``PATH``, set anew): the
# locale and time zone, the course's own switches, Jupyter's.  Nothing else of the grader's
# environment -- a database URL and its password, tokens, the instructor's paths -- reaches
# student code.
INHERITED_ENVIRONMENT = ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "ATTENTION_LAB_DEVICE",
                         "ATTENTION_LAB_HINT_LOG", "JPY_PARENT_PID", "JPY_SESSION_NAME")


def kernel_environ(environ: dict[str, str]) -> dict[str, str]:
    """The allowed part of ``environ`` (see :data:`INHERITED_ENVIRONMENT`), with a ``PATH`` of
    the virtual environment and the system's programs: what ``launch`` hands on (a kernel
    started afresh, the kernel server, which filters its own as well: see
    :func:`autograder.isolation.kernel_forkserver.serve`)."""
    allowed = {*INHERITED_ENVIRONMENT, *kernel_environment(), *SANDBOX_ENVIRONMENT}
    kept = {name: value for name, value in environ.items() if name in allowed}
    kept["PATH"] = kernel_path()
    return kept


def kernel_path() -> str:
    """A kernel's ``PATH``: the virtual environment's programs, then the system's."""
    return os.pathsep.join([str(Path(sys.prefix).resolve() / "bin"), "/usr/local/bin", "/usr/bin", "/bin"])


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


def kill_children(spare: int | tuple[int | None, ...] | None = None) -> list[int]:
    """SIGKILL and reap every child of this process (with :func:`adopt_orphans`: every descendant).

    Reaping a bubblewrap sandbox's init returns only once everything in the sandbox is gone.
    ``spare``: children left alone (the nbgrader process's kernel server and checker).  Returns the pids killed.
    """
    import signal

    spared = [pid for pid in (spare if isinstance(spare, tuple) else (spare,)) if pid]
    killed = list(spared)
    while children := [child.pid for child in psutil.Process().children() if child.pid not in killed]:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        killed += children
    return [pid for pid in killed if pid not in spared]


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    sub = parser.add_subparsers(dest="command")
    launch = sub.add_parser("launch", help="join the control group, apply the resource limits, keep the "
                            "allowed environment, then exec the command")
    launch.add_argument("--cgroup", action="append", default=[], help="a cgroup.procs file to join (repeatable)")
    launch.add_argument("--memory-mb", type=int, default=0)
    launch.add_argument("--file-mb", type=int, default=0)
    launch.add_argument("cmd", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    if options.command == "launch":
        cmd = options.cmd[1:] if options.cmd[:1] == ["--"] else options.cmd
        try:
            cgroups.join(options.cgroup)
        except OSError as error:
            print(f"sandbox: cannot start the kernel: cannot join its control group: {error}", file=sys.stderr, flush=True)
            return 127
        set_limits(options.memory_mb, options.file_mb)
        try:
            os.execvpe(cmd[0], cmd, kernel_environ(dict(os.environ)))
        except OSError as error:  # the grader reports this line as the cause (grade.start_failure_cause)
            print(f"sandbox: cannot start the kernel: {cmd[0]}: {error.strerror}", file=sys.stderr, flush=True)
            return 127
    reason = unavailable_reason()
    print(f"no sandbox: {reason}; make grade refuses to grade (SANDBOX=off grades without isolation)" if reason
          else f"bubblewrap sandbox available: {bwrap_path()}")
    group = cgroups.available()
    print(f"limits for a whole sandbox (memory of all its processes, process count, CPU time): {group}" if group
          else "no control group available: memory and process limits hold per process only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
