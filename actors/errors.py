"""One line for an error: what logs, job reasons and one-line CLI or API messages show.

The lowest layer that needs it (workers, the job drivers and their runtimes, the service
and its HTTP client all use it), with no imports of its own.
"""

from __future__ import annotations


def one_line(text: str) -> str:
    """``text`` with its whitespace (newlines, tracebacks) folded to single spaces."""
    return " ".join(str(text).split())


def first_line(err: BaseException, *, typed: bool = True, limit: int | None = 300) -> str:
    """The first non-blank line of ``err``'s message, whitespace folded, at most ``limit``
    characters: ``ValueError: bad value`` (``typed``) or ``bad value``; just the type's name
    when the message is empty. A Ray task error's own first line names only the task
    (``ray::Worker.join()``): what the task raised, its ``cause``, is described instead."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and cause is not err:
        err = cause
    lines = str(err).strip().splitlines()
    line = " ".join(lines[0].split()) if lines else ""
    if not line:
        out = type(err).__name__
    elif typed:
        out = f"{type(err).__name__}: {line}"
    else:
        out = line
    return out if limit is None else out[:limit]


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` says a device ran out of memory: torch's ``OutOfMemoryError`` (CUDA's
    caching allocator), or a ``RuntimeError`` whose message says "out of memory" (what
    older torch versions and other allocators raise). By name, so this module imports
    nothing."""
    if any(t.__name__ == "OutOfMemoryError" for t in type(err).__mro__):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


class TransportError(Exception):
    """A remote call failed in Ray's transport, not in the caller's code. Ray raises an IO
    error on a worker's connection to its own raylet (the node is going away: "Broken
    pipe") as a plain ``OSError``, which reads like an error the worker's code raised; a
    worker re-raises it as this, so whoever classifies the failure counts the worker lost
    (its node or process went), not wrong."""


class UserError(Exception):
    """A mark on an error in the job's own data, model or configuration (a token id beyond
    the model's vocabulary, dict samples whose keys differ): the same step fails the same
    way on any node, so the job fails at once, naming it, instead of retrying it as a
    fault (``scheduler/core/failures.py``). Mixed into the error's own class, e.g.
    ``class TokenIdError(WorkloadError, UserError)``."""


def is_user_error(err: BaseException) -> bool:
    """Whether ``err``, or what a Ray task error says its task raised (its ``cause``), is a
    :class:`UserError`."""
    cause = getattr(err, "cause", None)
    return isinstance(err, UserError) or isinstance(cause, UserError)
