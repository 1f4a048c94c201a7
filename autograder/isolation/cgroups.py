"""Limits that hold for a grading sandbox as a whole: a control group per nbgrader process.

Resource limits (``setrlimit``) hold per process: three forked children may each use the
memory limit, and uid 0 (the grader as root, the sandbox's own uid 0) is exempt from the
process-count limit.  A control group holds them for every process of the sandbox (the
kernel server, its kernels and whatever they start) together:

* **cgroup v2** where this process's own cgroup delegates the ``memory`` and ``pids``
  controllers to sub-groups it may create (a delegated cgroup: root on a pure-v2 machine,
  a container given its own cgroup, ``systemd-run --user -p Delegate=yes ...``);
* **cgroup v1** where the ``memory``, ``pids`` and ``cpuacct`` hierarchies are mounted and
  writable (hybrid machines and containers, as root);
* none otherwise: the per-process limits still hold, and ``make grade``'s report says which
  limits hold on the machine (:func:`available`).

:class:`Group` is one nbgrader process's group: created with the limits, joined by the sandbox's
first process (``python -m autograder.isolation.sandbox launch --cgroup ...``, before it ``exec``s
bubblewrap), read for the CPU time a submission used, removed with the nbgrader process.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpuacct")
PREFIX = "attention-lab-"   # a group's name: PREFIX<pid of the grader that made it>-<number>
_names = itertools.count()


def _own_paths() -> dict[str, str]:
    """``{controller: path}`` of this process's cgroups (``""``: the v2 hierarchy)."""
    paths = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _v2_base() -> Path | None:
    path = _own_paths().get("")
    if path is None:
        return None
    for mount in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        if (mount / "cgroup.controllers").exists():
            base = mount / path.lstrip("/")
            try:
                delegated = set((base / "cgroup.subtree_control").read_text().split())
            except OSError:
                return None
            return base if {"memory", "pids"} <= delegated and os.access(base, os.W_OK) else None
    return None


def _v1_bases() -> dict[str, Path] | None:
    own = _own_paths()
    bases = {}
    for controller in V1_CONTROLLERS:
        mount = CGROUP_ROOT / controller
        if controller not in own or not (mount / "cgroup.procs").exists():
            return None
        base = mount / own[controller].lstrip("/")
        if not base.is_dir():  # a cgroup namespace shows this process's group as the root
            base = mount
        if not os.access(base, os.W_OK):
            return None
        bases[controller] = base
    return bases


@dataclass
class Group:
    """One sandbox's control group (one folder per hierarchy: one under v2, three under v1)."""

    version: int
    folders: dict[str, Path]          # controller ("" under v2) -> folder

    @classmethod
    def create(cls, memory_mb: int, processes: int) -> Group | None:
        """A new group with these limits (0: none), or None where this machine offers none."""
        name = f"{PREFIX}{os.getpid()}-{next(_names)}"
        v2 = _v2_base()
        if v2 is not None:
            group = cls(2, {"": v2 / name})
        else:
            v1 = _v1_bases()
            if v1 is None:
                return None
            group = cls(1, {controller: base / name for controller, base in v1.items()})
        for folder in group.folders.values():
            _remove_stale(folder.parent)
        try:
            for folder in group.folders.values():
                folder.mkdir()
            group._set_limits(memory_mb, processes)
        except OSError:
            group.remove()
            return None
        return group

    def _file(self, controller: str, v2_name: str, v1_name: str) -> Path:
        return self.folders[""] / v2_name if self.version == 2 else self.folders[controller] / v1_name

    def _set_limits(self, memory_mb: int, processes: int) -> None:
        if memory_mb > 0:
            limit = str(memory_mb * 2**20)
            if self.version == 2:
                self._file("memory", "memory.max", "").write_text(limit)
                with contextlib.suppress(OSError):  # no swap beyond the limit (absent without swap accounting)
                    (self.folders[""] / "memory.swap.max").write_text("0")
            else:
                self.folders["memory"].joinpath("memory.limit_in_bytes").write_text(limit)
                with contextlib.suppress(OSError):  # memory + swap: the same (absent without swap accounting)
                    self.folders["memory"].joinpath("memory.memsw.limit_in_bytes").write_text(limit)
        if processes > 0:
            self._file("pids", "pids.max", "pids.max").write_text(str(processes))

    @property
    def procs_files(self) -> list[str]:
        """The files a process writes its pid into to join the group (every hierarchy's)."""
        return [str(folder / "cgroup.procs") for folder in self.folders.values()]

    def cpu_seconds(self) -> float:
        """CPU time used by every process that was ever in the group."""
        try:
            if self.version == 2:
                for line in (self.folders[""] / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
                return 0.0
            return int((self.folders["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return 0.0

    def unowned_bytes(self) -> int | None:
        """Memory charged to the group that none of its processes holds: what outlived them (a file of a
        tmpfs, a System V segment nobody has attached), which the next student's kernels would find
        missing from their limit.  The group's anonymous and shared memory (never page cache, which the
        kernel reclaims under pressure) less what its live processes map of either; None where the group
        says nothing of its memory."""
        folder = self.folders["" if self.version == 2 else "memory"]
        try:
            stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
            pids = (folder / "cgroup.procs").read_text().split()
        except (OSError, ValueError):
            return None
        charged = sum(int(stat.get(key, 0)) for key in (("anon", "shmem") if self.version == 2 else ("rss", "shmem")))
        return max(0, charged - sum(_mapped_bytes(pid) for pid in pids))

    def remove(self) -> None:
        """Remove the group's folders (once its processes are gone: the nbgrader process waits for them)."""
        for folder in self.folders.values():
            for _ in range(50):  # a killed process leaves its group a moment after it is reaped
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def _mapped_bytes(pid: str) -> int:
    """Anonymous and shared memory a process maps (``RssAnon`` + ``RssShmem``), 0 once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return sum(int(line.split()[1]) * 1024 for line in lines if line.startswith(("RssAnon:", "RssShmem:")))


def _remove_stale(base: Path) -> None:
    """Remove the empty groups of graders that are gone (a killed Dask worker cannot)."""
    with contextlib.suppress(OSError):
        for folder in base.glob(f"{PREFIX}*-*"):
            owner = folder.name[len(PREFIX):].split("-")[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                with contextlib.suppress(OSError):
                    folder.rmdir()  # (refused while a process is still in it)


def join(procs_files: list[str]) -> None:
    """Move this process into a group (see :attr:`Group.procs_files`)."""
    for path in procs_files:
        with open(path, "w") as handle:
            handle.write(str(os.getpid()))


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """``"cgroup v2"`` or ``"cgroup v1"`` where this process can give a sandbox a group, else None."""
    group = Group.create(0, 0)
    if group is None:
        return None
    group.remove()
    return f"cgroup v{group.version}"
