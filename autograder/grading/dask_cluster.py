"""The grading engine: Dask (parent process side).

By default an embedded ``LocalCluster``: ``jobs`` worker processes with one thread each, on
this machine, started for the run and stopped after it (no service to start).  With
``scheduler="tcp://host:8786"`` (``make grade SCHEDULER=...``) the tasks go to an existing
Dask cluster (``dask scheduler`` / ``dask worker``, dask-jobqueue, Kubernetes) whose workers
have the course installed (docs/instructors/6-grading-at-scale.md).

Each task carries bytes only (:func:`autograder.grading.task.grade_submission`): the
assignment's source folder and template gradebook, sent to the cluster once per assignment
(``scatter``), and the student's files.  A worker that dies in the middle of a task (killed,
out of memory) costs nothing: the scheduler gives its task to another worker, and the
parent merges each task's one result, so nothing is lost and nothing is graded twice.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import sys
import uuid
from urllib.parse import urlsplit
from collections.abc import Iterator
from dataclasses import dataclass

from autograder.grading import task as worker_task

# Dask's own: how many workers may die running one task before it is given up on.
ALLOWED_FAILURES = 3
# How the embedded cluster starts its worker processes (forkserver: everywhere but Windows).
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


# Run on the scheduler and each worker before anything is submitted (``exec`` travels by name:
# no module of the course is needed to receive it).
COURSE_IMPORT = "import autograder.grading.task"
START_COMMANDS = ("start them from the course's clone as docs/instructors/6-grading-at-scale.md says: "
                  "`make dask-scheduler` on the scheduler machine, `make dask-worker SCHEDULER=...` on each worker "
                  "machine (both put the clone on PYTHONPATH)")


def scheduler_problem(scheduler: str) -> str | None:
    """Why ``scheduler`` (``tcp://host:8786``) cannot be a scheduler's address, or None: a host
    this machine cannot find (``scheduler-host`` copied literally from the README) is said as
    such, where Dask would say only "Nanny failed to start" or time out."""
    parts = urlsplit(scheduler if "://" in scheduler else f"tcp://{scheduler}")
    usage = "SCHEDULER=tcp://<the scheduler machine's name or address>:8786 (`make dask-scheduler` runs there)"
    try:
        port = parts.port
    except ValueError:
        return f"{scheduler}: the port is not a number; {usage}"
    if not parts.hostname or port is None:
        return f"{scheduler}: expected a host and a port; {usage}"
    try:
        socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        return (f"{scheduler}: the host {parts.hostname!r} was not found ({error.strerror}): name the scheduler "
                f"machine as this machine can reach it; {usage}")
    return None


def check_cluster(client, scheduler: str) -> None:
    """Refuse, with the real error in full, a cluster whose scheduler or workers cannot import
    the course: otherwise the scheduler fails each task with an error that names no cause."""
    for where, attempt in (("scheduler", lambda: client.run_on_scheduler(exec, COURSE_IMPORT)),
                           ("workers", lambda: client.run(exec, COURSE_IMPORT))):
        try:
            attempt()
        except Exception as error:
            raise SystemExit(f"the Dask {where} at {scheduler} cannot import the course: "
                             f"{type(error).__name__}: {error}\n{START_COMMANDS}") from None


@dataclass
class Cluster:
    client: object                      # distributed.Client
    description: str                    # for the console and the report


@contextlib.contextmanager
def cluster(jobs: int, scheduler: str | None = None, processes: bool = True) -> Iterator[Cluster]:
    """A Dask client: on ``scheduler`` if given, else on an embedded ``LocalCluster``.

    ``processes=False`` runs the local workers as threads of this process (the nbgrader
    nbgrader processes and the kernels are processes of their own either way).
    """
    import dask
    from distributed import Client, LocalCluster

    with contextlib.ExitStack() as stack:
        if scheduler:
            problem = scheduler_problem(scheduler)
            if problem:
                raise SystemExit(problem)
            client = stack.enter_context(Client(scheduler, timeout="60s"))
            check_cluster(client, scheduler)
            workers = client.scheduler_info().get("workers", {})
            description = f"Dask cluster at {scheduler} ({len(workers)} workers now)"
        else:
            # Worker processes forked from a server that has imported Dask once, instead of
            # each starting Python and importing Dask itself; they get this process's
            # environment as it is now (a forked worker would otherwise see the server's).
            # No statistical profiler in the workers: it samples every thread's stack every
            # 10 ms, CPU taken from the kernels, for a dashboard nobody looks at here.
            stack.enter_context(dask.config.set({"distributed.scheduler.allowed-failures": ALLOWED_FAILURES,
                                                 "distributed.worker.daemon": False,
                                                 "distributed.worker.multiprocessing-method": START_METHOD,
                                                 "distributed.worker.profile.enabled": False}))
            local = stack.enter_context(LocalCluster(
                n_workers=jobs, threads_per_worker=1, processes=processes, memory_limit=0,
                dashboard_address=":0", silence_logs=logging.ERROR, scheduler_port=0,
                **({"env": dict(os.environ)} if processes else {})))
            client = stack.enter_context(Client(local))
            description = f"Dask LocalCluster, {jobs} worker {'processes' if processes else 'threads'} x 1 thread"
        try:
            yield Cluster(client, description)
        finally:
            if not scheduler:  # the embedded workers' nbgrader processes end with the run; a shared
                with contextlib.suppress(Exception):  # cluster's serve the next run (and other graders')
                    client.run(worker_task.stop_nbgrader_processes)


def run(connection: Cluster, shared: dict[str, dict], tasks: list[dict]) -> Iterator[tuple[int, dict | None, str]]:
    """Submit every task; yield ``(index, result, error)`` in the order they finish.

    ``shared``: ``{assignment: {"source": ..., "template": ...}}``, scattered once and
    referenced by each task of that assignment.  ``error`` is set (and ``result`` None) when
    Dask itself gave up on a task: the error in full, and why Dask gave up.
    """
    from distributed import KilledWorker
    from distributed import as_completed

    client = connection.client
    scattered = {assignment: {name: client.scatter(value, broadcast=False, hash=False)
                              for name, value in parts.items()} for assignment, parts in shared.items()}
    futures = {}
    for index, payload in enumerate(tasks):
        payload = {**payload, **scattered[payload["assignment"]], "index": index}
        # a key of its own: several grading runs may share one cluster
        future = client.submit(worker_task.grade_submission, payload, pure=False,
                               key=f"grade-{payload['student']}/{payload['assignment']}-{uuid.uuid4().hex[:12]}")
        futures[future] = index
    for future in as_completed(futures):
        index = futures[future]
        try:
            yield index, future.result(), ""
        except KilledWorker as error:  # the task's workers died ALLOWED_FAILURES times
            yield index, None, f"the Dask workers running it kept dying: {type(error).__name__}: {error}"
        except Exception as error:
            yield index, None, f"the Dask cluster could not run it: {type(error).__name__}: {error}"
        finally:
            future.release()


def main(argv: list[str] | None = None) -> int:
    """``python -m autograder.grading.dask_cluster tcp://host:8786``: the address checked before
    ``make dask-worker`` starts Dask's worker (exit 2, saying why, when it cannot be one)."""
    arguments = sys.argv[1:] if argv is None else argv
    if len(arguments) != 1:
        print("usage: python -m autograder.grading.dask_cluster tcp://<scheduler host>:<port>", file=sys.stderr)
        return 2
    problem = scheduler_problem(arguments[0])
    if problem:
        print(problem, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
