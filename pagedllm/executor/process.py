"""Start pagedllm's own processes (mp workers, engine cores) without re-running the user's script.

multiprocessing's spawn re-imports the parent's ``__main__`` in every child, so a script that
builds an engine at top level (``LLM(model, tensor_parallel_size=2)``, as vLLM allows) builds it
again there. Fork is no way out (a fork of a process holding torch threads or a CUDA context can
deadlock). So a child here is a fresh interpreter running ``python -m pagedllm.executor.process_main``:
it reads the call to make (``target(*args)``, pickled) from a pipe and runs it; the user's script
is imported only when the call itself refers to something defined in it (a runner class in a
guarded script), as spawn would have done.

Two pipes stand in for multiprocessing's process sentinels:

* parent -> child: carries the call, then stays open for the parent's life; the child's
  ``parent_process().sentinel`` becomes readable (EOF) when the parent is gone, however it ended.
* child -> parent: the child holds the write end and never writes; ``ChildProcess.sentinel``
  becomes readable when the child ends (killed -9 included).

Both are plain file descriptors: ``zmq.Poller`` and ``multiprocessing.connection.wait`` take them.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import types
import weakref
from typing import Any, Callable

import pagedllm
from pagedllm import envs

ENTRY_MODULE = "pagedllm.executor.process_main"
_LENGTH = struct.Struct("<Q")
_parent: "ParentProcess | None" = None  # set in a child started here
_importing_main = False  # a child importing the user's script: it must not start processes


class ChildProcess:
    """``target(*args)`` in a fresh interpreter; the part of ``multiprocessing.Process`` the
    executors use (``pid``, ``sentinel``, ``is_alive``, ``exitcode``, ``join``, ``terminate``,
    ``kill``, ``close``). ``env``: variables set before the interpreter starts (torch reads its
    thread count at import)."""

    def __init__(self, target: Callable[..., Any], args: tuple = (), *, name: str,
                 env: dict[str, str] | None = None) -> None:
        if _importing_main:
            raise RuntimeError(f"{name}: the main script started an engine while a pagedllm process "
                               f"imported it for a definition it needs; put that code under "
                               f"`if __name__ == \"__main__\":`")
        self.name = name
        header, body = _encode_call(target, args)
        to_child_r, self._to_child = os.pipe()
        self.sentinel, alive_w = os.pipe()
        child_env = dict(os.environ, **(env or {}))
        # The child must import this same pagedllm before it can read sys.path from the pipe.
        root = os.path.dirname(os.path.dirname(os.path.abspath(pagedllm.__file__)))
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, envs.pythonpath()]))
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-m", ENTRY_MODULE, str(to_child_r), str(alive_w), name],
                pass_fds=(to_child_r, alive_w), env=child_env)
        except BaseException:
            os.close(self._to_child)
            os.close(self.sentinel)
            raise
        finally:
            os.close(to_child_r)
            os.close(alive_w)
        self.pid: int = self._popen.pid
        # The pipes close with the object at the latest (the child then sees its parent gone).
        self._finalizer = weakref.finalize(self, _close_fds, self._to_child, self.sentinel)
        try:
            for blob in (header, body):
                _write_all(self._to_child, _LENGTH.pack(len(blob)) + blob)
        except BrokenPipeError:
            pass  # it died before reading: is_alive()/exitcode say so, as for any death

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        """None while running; negative: killed by that signal (multiprocessing's convention)."""
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.is_alive():
            try:
                self._popen.send_signal(signum)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Release the pipes (the child, if still running, then sees its parent gone)."""
        self._finalizer()


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class ParentProcess:
    """The parent, seen from a child started here (``multiprocessing.parent_process()``'s API)."""

    def __init__(self, fd: int) -> None:
        self.sentinel = fd

    def is_alive(self) -> bool:
        readable, _, _ = select.select([self.sentinel], [], [], 0)
        return not readable  # the call was read in full: readable now means EOF


def parent_process() -> Any:
    """This process's parent handle (``sentinel``, ``is_alive()``), or None in a top process."""
    return _parent if _parent is not None else multiprocessing.parent_process()


def _encode_call(target: Callable[..., Any], args: tuple) -> tuple[bytes, bytes]:
    """(header, body): the header says how to prepare the child before the body unpickles."""
    import io

    buf = io.BytesIO()
    pickler = _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dump((target, args))
    main = _main_ref() if pickler.uses_main else None
    header = pickle.dumps({"sys_path": list(sys.path), "pythonpath": envs.pythonpath(),
                           "main": main})
    return header, buf.getvalue()


class _Pickler(pickle.Pickler):
    """Notes whether the call refers to anything defined in ``__main__``."""

    uses_main = False

    def reducer_override(self, obj: Any) -> Any:
        owner = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
        if getattr(owner, "__module__", None) == "__main__":
            self.uses_main = True
        return NotImplemented


def _main_ref() -> tuple[str, str] | None:
    """How a child imports the parent's ``__main__``: by module name (``python -m``) or path."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and not spec.name.endswith("__main__"):
        return ("module", spec.name)
    path = getattr(main, "__file__", None)
    return ("path", os.path.abspath(path)) if path else None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("the parent closed the pipe before sending the call")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_blob(fd: int) -> bytes:
    (n,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size))
    return _read_exactly(fd, n)


def child_main(argv: list[str]) -> None:
    """The child's side (``process_main``): read the call, prepare as the header says, run it."""
    global _parent, _importing_main
    from_parent, alive_w, name = int(argv[0]), int(argv[1]), argv[2]
    # Neither pipe may leak into this process's own children: they would hold it open.
    os.set_inheritable(from_parent, False)
    os.set_inheritable(alive_w, False)  # kept open, never written, until this process ends
    header = pickle.loads(_read_blob(from_parent))
    body = _read_blob(from_parent)
    sys.path[:] = header["sys_path"]
    if header["pythonpath"] is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = header["pythonpath"]
    multiprocessing.current_process().name = name
    _parent = ParentProcess(from_parent)
    if header["main"] is not None:
        _importing_main = True
        try:
            _import_main(*header["main"])
        finally:
            _importing_main = False
    target, args = pickle.loads(body)
    target(*args)


def _import_main(kind: str, ref: str) -> None:
    """Import the parent's main script as ``__mp_main__`` (its guarded part does not run), so
    the call's references to ``__main__`` resolve, as under multiprocessing's spawn."""
    import runpy

    module = types.ModuleType("__mp_main__")
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    if kind == "module":
        namespace = runpy.run_module(ref, run_name="__mp_main__", alter_sys=True)
    else:
        namespace = runpy.run_path(ref, run_name="__mp_main__")
    module.__dict__.update(namespace)
