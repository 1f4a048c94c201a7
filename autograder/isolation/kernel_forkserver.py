"""Grading kernels forked from one sandboxed server that has imported torch once.

A grading kernel spends about 2 s of CPU before it runs the notebook's first cell: Python,
ipykernel, torch and the course package, the same for every student -- a third of what
grading a short notebook costs.  Under bubblewrap, each nbgrader process therefore starts one
kernel server in the sandbox, which imports them once; each notebook's kernel is then a
fork of it (copy-on-write), started in milliseconds, and the server never runs student code.

Students stay apart, as with a fresh sandbox per kernel:

* the server is PID 1 of the sandbox's PID namespace: a kernel cannot kill it (PID 1
  ignores signals it does not handle, SIGKILL included, from inside its namespace), and
  it is not dumpable, so a kernel cannot ptrace it either;
* when a kernel ends, and whenever the nbgrader process asks (before it answers for a student), the
  server kills every other process of the namespace (``kill(-1)``), empties the
  sandbox's ``/tmp`` (``HOME``, ``IPYTHONDIR``) and ``/dev/shm``, making writable again what
  a kernel made read-only, and removes every System V shared memory segment, message queue
  and semaphore set and every POSIX message queue of the sandbox's IPC namespace (one for all
  its kernels: a segment left there would carry one student's message to the next, and stay
  charged to the sandbox's memory): every kernel starts on fresh scratch folders and an empty
  IPC namespace, and nothing a student started or left there reaches the next kernel, whose
  working and runtime folders the nbgrader process empties itself;
* it listens on a socket the nbgrader process created, in a folder the sandbox hides, and inherited
  as a file descriptor that each kernel closes: no kernel can reach it;
* each kernel gets its own session, resource limits, working folder, environment (the
  allowed part of the one Jupyter gave it: ``--allow``; the server itself starts again
  with only the allowed variables, which a forked kernel would find in its
  ``/proc/self/environ``) and a new numpy seed; its ``sys.path`` is a fresh kernel's; when
  the sandbox runs out of memory (its control group's limit), the out-of-memory killer
  takes a kernel or what it started, not the server.

This file runs as a script inside the sandbox, where the repository is hidden and only
this file is shown: it imports nothing but the standard library (and the preloaded
modules).

    python kernel_forkserver.py serve --listen-fd N --workdir-root D --runtime-dir R --keep VAR,... --allow VAR,... --preload M,...
    python kernel_forkserver.py kernel --socket PATH --memory-mb N --file-mb M -f CONNECTION_FILE

``serve`` is the server (started by :class:`Server`, in the nbgrader process); ``kernel`` is the
kernelspec's command, which Jupyter starts: it asks the server for a kernel and lives as
long as that kernel, exiting with its status (killing it kills the kernel).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import time
import traceback

PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
# What the server imports once for all its kernels: what every kernel imports before the
# notebook's first cell runs, and what the course's setup cell imports (for notebooks that
# have it).  Importing them creates no CUDA context, which a forked kernel could not use.
# torch._dynamo: torch imports it (about 1 s of CPU) the first time a notebook creates an
# optimizer or counts FLOPs, as notebooks 01, 03, 04 and 06 do. It imports Triton, so the
# sandbox sets TRITON_INTERPRET first (autograder.isolation.sandbox.SANDBOX_ENVIRONMENT): imported
# before Triton's interpreter is chosen, notebook 06's kernels fail (tests/test_corpus.py).
# The widgets (matplotlib, ipywidgets), which every notebook shows, and matplotlib's font list:
# a kernel builds that list into MPLCONFIGDIR, which is in the sandbox's /tmp, emptied after
# every student, so each kernel scanned the system's fonts again (a notebook-01 submission
# graded in 2.6 s instead of 3.3 s with these preloaded); and one small figure drawn, which
# loads the fonts and glyphs every widget's first picture needed (notebook 01's attention
# explorer: 1.4 s, 0.7 s after it).
KERNEL_MODULES = ("ipykernel.kernelapp",)
COURSE_MODULES = ("torch", "torch._dynamo", "attention_lab", "matplotlib.font_manager",
                  "attention_lab.widgets.live:warm_up")
# Folders of the sandbox that kernels may write and that no folder of the nbgrader process backs.
SANDBOX_SCRATCH = ("/tmp", "/dev/shm")
# Where the sandbox mounts its IPC namespace's POSIX message queues (bwrap --mqueue): a queue is a file there.
POSIX_QUEUES = "/dev/mqueue"
# The System V IPC objects of this IPC namespace, as Linux lists them, and how each kind is removed.
SYSTEM_V_IPC = {"shm": "shmctl", "msg": "msgctl", "sem": "semctl"}
IPC_RMID = 0


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def set_limits(memory_mb: int, file_mb: int) -> None:
    """A grading kernel's limits: address space, size of a written file, no core dump; and
    ``PR_SET_PDEATHSIG``, so that it dies with whatever started it."""
    import resource

    if memory_mb > 0:
        limit = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if file_mb > 0:
        limit = file_mb * 2**20
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Channel:
    """JSON lines over a connected Unix socket."""

    def __init__(self, connection: socket.socket):
        self.socket = connection
        self._reader = connection.makefile("rb")

    def send(self, message: dict) -> None:
        with contextlib.suppress(OSError):
            self.socket.sendall((json.dumps(message) + "\n").encode())

    def receive(self, timeout: float | None = None) -> dict | None:
        """The next message; None when the other end closed first, or after ``timeout`` s."""
        self.socket.settimeout(timeout)
        try:
            line = self._reader.readline()
            return json.loads(line) if line else None
        except (OSError, ValueError):
            return None
        finally:
            with contextlib.suppress(OSError):
                self.socket.settimeout(None)

    def close(self) -> None:
        self._reader.close()
        self.socket.close()


# --------------------------------------------------------------------------------------
# The server (PID 1 of the sandbox)
# --------------------------------------------------------------------------------------

def _others() -> list[int]:
    """Every process of this PID namespace but this one (PID 1)."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and name != "1"]


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def empty_folder(folder: str | os.PathLike, keep: tuple[str, ...] = ()) -> None:
    """Remove what ``folder`` holds, links themselves (never what they point to), on its own
    file system only: the folders the nbgrader process shows inside the sandbox (bind mounts: the
    kernels' working and runtime folders, which ``/tmp`` holds when the nbgrader process's scratch
    folder is under ``/tmp``) are not crossed.  The sub-folders named in ``keep`` stay, emptied.
    A folder made read-only (``chmod 0555``) is made writable again first: its owner may,
    without any capability.
    """
    try:
        device = os.lstat(folder).st_dev
        with contextlib.suppress(OSError):
            os.chmod(folder, stat.S_IRWXU | os.lstat(folder).st_mode & 0o777)
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                if entry.stat(follow_symlinks=False).st_dev == device:
                    empty_folder(entry.path)
                    if entry.name not in keep:
                        os.rmdir(entry.path)  # (fails, rightly, on a folder that holds a mount point)
            else:
                os.unlink(entry.path)


def _system_v_ids(kind: str) -> list[int]:
    """The ids of this IPC namespace's System V objects of ``kind`` (shm, msg, sem)."""
    try:
        lines = open(f"/proc/sysvipc/{kind}").read().splitlines()[1:]
    except OSError:
        return []
    return [int(line.split()[1]) for line in lines if len(line.split()) > 1 and line.split()[1].isdigit()]


def remove_ipc() -> int:
    """Remove every System V shared memory segment, message queue and semaphore set of this IPC
    namespace and every POSIX message queue; return how many.  Run once the kernels are killed: a
    segment nobody has attached goes at once, with the memory it held.  (The server has the uid of
    every kernel, their creator: ``IPC_RMID`` is allowed whatever permissions a kernel set.)"""
    libc = ctypes.CDLL(None, use_errno=True)
    removed = 0
    for kind, function in SYSTEM_V_IPC.items():
        for ipc_id in _system_v_ids(kind):
            # shmctl(id, IPC_RMID, NULL), msgctl(id, IPC_RMID, NULL), semctl(id, 0, IPC_RMID)
            arguments = (ipc_id, 0, IPC_RMID) if kind == "sem" else (ipc_id, IPC_RMID, None)
            removed += getattr(libc, function)(*arguments) == 0
    with contextlib.suppress(OSError):
        for name in os.listdir(POSIX_QUEUES):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(POSIX_QUEUES, name))
                removed += 1
    return removed


def clean() -> int:
    """Kill every other process of the namespace, reap them, empty the sandbox's scratch
    folders and IPC namespace; return how many processes were killed."""
    killed = 0
    while others := _others():
        killed = max(killed, len(others))
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)  # from PID 1: every process of the namespace but itself
        _reap()
        time.sleep(0.005)
    for folder in SANDBOX_SCRATCH:
        empty_folder(folder)
    remove_ipc()
    return killed


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def _kernel(listener: socket.socket, client: Channel, request: dict, keep: dict[str, str], allow: set[str]) -> None:
    """The forked kernel: never returns."""
    try:
        listener.close()
        client.close()
        os.setsid()
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(number, signal.SIG_DFL)
        _prctl(PR_SET_DUMPABLE, 1)  # as any process (the server is not dumpable)
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("1000")  # out of memory in the sandbox's group: a kernel goes, not the server
        set_limits(request["memory_mb"], request["file_mb"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**{k: v for k, v in request["env"].items() if k in allow}, **keep, "PWD": request["cwd"]})
        # what ipykernel_launcher sees: without this file's folder on the path (ipykernel adds '')
        del sys.path[0]
        sys.argv = [importlib.util.find_spec("ipykernel_launcher").origin, "-f", request["connection_file"],
                    *request.get("arguments", [])]
        if "numpy" in sys.modules:  # forked: every kernel would draw the server's numbers
            sys.modules["numpy"].random.seed()
        from ipykernel.kernelapp import IPKernelApp

        IPKernelApp.launch_instance(sys.argv[1:])
        status = 0
    except SystemExit as error:
        status = error.code if isinstance(error.code, int) else 1
    except BaseException:
        traceback.print_exc()
        status = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


def _serve_kernel(listener: socket.socket, client: Channel, request: dict, keep: dict[str, str],
                  allow: set[str]) -> None:
    """Fork the kernel, tell the client its pid, then its exit status; kill it if the client goes."""
    pid = os.fork()
    if pid == 0:
        _kernel(listener, client, request, keep, allow)
    client.send({"pid": pid})
    exited = os.pidfd_open(pid)
    try:
        while True:
            ready = select.select([client.socket, exited], [], [])[0]
            if exited in ready:
                client.send({"exit": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])})
                return
            try:
                data = client.socket.recv(4096)
            except OSError:
                data = b""
            if not data:  # the client was killed (Jupyter shut the kernel down): so is the kernel
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
    finally:
        os.close(exited)


def serve(listen_fd: int, workdir_root: str, runtime_dir: str, keep: list[str], allow: list[str],
          preload: list[str]) -> int:
    if os.getpid() != 1:
        print("kernel_forkserver: serve runs only as PID 1 of a sandbox (bwrap --unshare-pid --as-pid-1): "
              "it kills every other process of its namespace", file=sys.stderr)
        return 2
    allowed = {*keep, *allow}
    if set(os.environ) - allowed:  # a kernel, forked, would find the rest in its /proc/self/environ
        os.execve(sys.executable, sys.orig_argv, {k: v for k, v in os.environ.items() if k in allowed})
    _prctl(PR_SET_DUMPABLE, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    kept = {name: os.environ[name] for name in keep if name in os.environ}
    listener = socket.socket(fileno=listen_fd)
    for name in preload:  # "module", or "module:function" (imported, then called with no argument)
        try:
            module, _, function = name.partition(":")
            loaded = importlib.import_module(module)
            if function:
                getattr(loaded, function)()
        except Exception as error:  # a kernel imports it itself, if it can
            print(f"kernel_forkserver: cannot preload {name}: {error}", file=sys.stderr)
    clean()
    while True:
        client = Channel(listener.accept()[0])
        try:
            request = client.receive(timeout=30) or {}
            if request.get("kind") == "kernel":
                if _inside(request.get("cwd", "/"), workdir_root) and _inside(request.get("connection_file", "/"),
                                                                             runtime_dir):
                    _serve_kernel(listener, client, request, kept, set(allow))
                else:
                    client.send({"error": f"a kernel outside {workdir_root} or {runtime_dir}"})
            killed = clean()
            if request.get("kind") == "clean":
                client.send({"clean": killed})
        finally:
            client.close()


# --------------------------------------------------------------------------------------
# The kernelspec's command (outside the sandbox, started by Jupyter)
# --------------------------------------------------------------------------------------

def kernel(socket_path: str, connection_file: str, memory_mb: int, file_mb: int, arguments: list[str]) -> int:
    """Have the server at ``socket_path`` fork a kernel for ``connection_file``; wait for it,
    and return its exit status (127, with the cause on stderr, when none could start)."""
    connection = socket.socket(socket.AF_UNIX)
    try:
        connection.connect(socket_path)
    except OSError as error:
        print(f"sandbox: cannot start the kernel: no kernel server at {socket_path}: {error.strerror}",
              file=sys.stderr, flush=True)
        return 127
    server = Channel(connection)
    server.send({"kind": "kernel", "connection_file": os.path.abspath(connection_file), "cwd": os.getcwd(),
                 "env": dict(os.environ), "memory_mb": memory_mb, "file_mb": file_mb, "arguments": arguments})
    answer = server.receive()
    if answer is None or "pid" not in answer:
        reason = (answer or {}).get("error", "the kernel server stopped before it started the kernel")
        print(f"sandbox: cannot start the kernel: {reason}", file=sys.stderr, flush=True)
        return 127
    answer = server.receive()
    if answer is None:  # the server died (and the kernel with it)
        return 1
    status = answer["exit"]
    return 128 - status if status < 0 else status  # killed by signal N: as a shell says it


# --------------------------------------------------------------------------------------
# The nbgrader process's side: one server per nbgrader process
# --------------------------------------------------------------------------------------

class Server:
    """The kernel server of one nbgrader process: (re)started when its command changes or it died."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.command: list[str] | None = None
        self.socket_path = ""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def ensure(self, command: list[str], socket_path: str, environment: dict[str, str]) -> None:
        """A running server for ``command`` (the sandbox's argv, ending with this file's
        ``serve``; ``--listen-fd`` is added), listening at ``socket_path``."""
        if self.process is not None and self.process.poll() is None and command == self.command \
                and socket_path == self.socket_path:
            return
        self.stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        listener = socket.socket(socket.AF_UNIX)
        try:
            listener.bind(socket_path)
            listener.listen(16)
            descriptor = listener.fileno()
            self.process = subprocess.Popen([*command, "--listen-fd", str(descriptor)], pass_fds=(descriptor,),
                                            env=environment, stdin=subprocess.DEVNULL)
        finally:
            listener.close()  # the server holds it: once it is gone, a client is refused at once
        self.command, self.socket_path = command, socket_path

    def clean(self, timeout: float = 60) -> bool:
        """Have the server kill whatever runs in its sandbox and empty its scratch folders;
        False (and the server stopped) when it did not answer."""
        if self.process is None or self.process.poll() is not None:
            return True
        connection = socket.socket(socket.AF_UNIX)
        server, answer = Channel(connection), None
        try:
            connection.settimeout(timeout)
            connection.connect(self.socket_path)
            server.send({"kind": "clean"})
            answer = server.receive(timeout)
        except OSError:
            pass
        finally:
            server.close()
        if answer is None or "clean" not in answer:
            self.stop()
            return False
        return True

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            self.process.wait()
            self.process = None
        if self.socket_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    server = sub.add_parser("serve", help="the kernel server (PID 1 of a sandbox)")
    server.add_argument("--listen-fd", type=int, required=True)
    server.add_argument("--workdir-root", required=True, help="kernels' working folders lie in it")
    server.add_argument("--runtime-dir", required=True, help="kernels' connection files lie in it")
    server.add_argument("--keep", default="", help="variables the sandbox set, kept over the kernel's own")
    server.add_argument("--allow", default="", help="variables a kernel keeps from the environment it was given")
    server.add_argument("--preload", default=",".join(KERNEL_MODULES), help="modules imported once for all kernels")
    client = sub.add_parser("kernel", help="start a kernel on the server; exit with it")
    client.add_argument("--socket", required=True)
    client.add_argument("--memory-mb", type=int, default=0)
    client.add_argument("--file-mb", type=int, default=0)
    client.add_argument("-f", dest="connection_file", required=True)
    options, rest = parser.parse_known_args(argv)
    if options.command == "serve":
        return serve(options.listen_fd, options.workdir_root, options.runtime_dir,
                     [name for name in options.keep.split(",") if name],
                     [name for name in options.allow.split(",") if name],
                     [name for name in options.preload.split(",") if name])
    return kernel(options.socket, options.connection_file, options.memory_mb, options.file_mb, rest)


if __name__ == "__main__":
    sys.exit(main())
