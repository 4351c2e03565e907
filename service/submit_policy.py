"""What a job spec submitted over REST may name: the service's submission policy.

A spec submitted over REST runs on the operator's cluster, not in its sender's process: its
import paths are code the cluster's processes import and call, and its paths are files they
read and write. The service checks it against a :class:`SubmitPolicy` from its settings
(:meth:`dynabatch.service.settings.Settings.submit_policy`) before storing or launching it;
``dynabatch run`` is the user's own process and checks none of this. The schema itself
(:mod:`dynabatch.actors.spec`) only says whether a spec is valid.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynabatch.actors.spec import IMPORT_PATH_PATTERN, URI_PATTERN, JobSpec
from dynabatch.actors.spec.sections import BUILTIN_OPTIMIZERS

ANY_MODULE = "*"  # the user_code_modules entry that allows any module


@dataclass(frozen=True)
class SubmitPolicy:
    """What the operator lets a submitted spec name. The default allows nothing.

    ``user_code_modules``: module prefixes that import paths may use (``"pkg"`` allows
    ``pkg`` and ``pkg.sub``, not ``pkgx``), or ``"*"`` for any module. ``data_roots``: the
    directories ``dataset.path`` must resolve under. ``checkpoint_root``: the directory
    ``checkpoint.dir`` must resolve under (``checkpoint.from`` under it or a data root).
    ``code_root``: where the service stores uploaded code (POST /v1/code); a ``working_dir``
    of ``file://`` or ``local://`` must be under it. ``artifact_root``: the directory or URI
    ``artifacts.dir`` must resolve under.
    """

    user_code_modules: tuple[str, ...] = ()
    data_roots: tuple[str, ...] = ()
    checkpoint_root: str | None = None
    code_root: str | None = None
    artifact_root: str | None = None


class SpecNotAllowed(ValueError):
    """A valid spec that names what the service does not allow, as (field, problem) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{field}: {problem}" for field, problem in problems))


# The settings that allow what a submitted spec may name, as operators set them.
USER_CODE_SETTING = "DYNABATCH_USER_CODE_MODULES"
CODE_ROOT_SETTING = "DYNABATCH_CODE_ROOT"


def shipping_refusal(policy: SubmitPolicy) -> str | None:
    """Why this service takes no shipped code, every reason at once (an operator fixes them
    in one go: what is missing and the setting that allows it); None when it takes it."""
    problems = []
    if ANY_MODULE not in policy.user_code_modules:
        problems.append(f"allows no user code from any module (needs {USER_CODE_SETTING}='*')")
    if policy.code_root is None:
        problems.append(f"has nowhere to keep it (needs {CODE_ROOT_SETTING}, a directory every "
                        "Ray node reads at the same path)")
    if not problems:
        return None
    return "shipping code is not allowed: this service " + "; and ".join(problems)


def module_allowed(module: str, allowed: Iterable[str]) -> bool:
    """Whether ``module`` is one of the ``allowed`` prefixes or below one (``*``: any)."""
    return any(a == ANY_MODULE or module == a or module.startswith(a + ".") for a in allowed)


# URIs whose path is on the nodes' own disks: the service only names its own uploads.
_NODE_PATH_SCHEMES = ("file", "local")


def working_dir_problem(value: str, code_root: str | None) -> str | None:
    """Why a submitted ``working_dir`` may not be used (None when it may). Shipped code is
    a URI: one of the service's own uploads (``file://`` under ``code_root``) or code that
    Ray fetches from elsewhere (``gcs://``, ``https://``...). A plain path would make the
    service read its own disk on the sender's behalf."""
    if not re.match(URI_PATTERN, value):
        return (f"{value!r} is a local path: upload the directory instead (`dynabatch submit "
                "--working-dir DIR` does, through POST /v1/code) or name a URI Ray can fetch")
    scheme, _, rest = value.partition("://")
    if scheme.lower() not in _NODE_PATH_SCHEMES:
        return None
    roots = () if code_root is None else (code_root,)
    return path_problem(rest, roots, "shipped code on the nodes' disks (DYNABATCH_CODE_ROOT)")


def check_user_code(spec: JobSpec, allowed: Iterable[str],
                    code_root: str | None = None) -> list[tuple[str, str]]:
    """(field, problem) for each import path in ``spec`` whose module is not ``allowed``, and
    for a ``working_dir`` the service may not ship."""
    allowed = tuple(allowed)
    problems = []
    named = [("dataset.name", spec.dataset.name), ("model.name", spec.model.name),
             ("optimizer.name", spec.optimizer.name)]
    if spec.dataset.collate:
        named.append(("dataset.collate", spec.dataset.collate))
    if spec.loss:
        named.append(("loss", spec.loss))
    if spec.model.output:
        named.append(("model.output", spec.model.output))
    named += [(f"metrics.{i}", m.fn) for i, m in enumerate(spec.metrics or ())]
    if spec.optimizer.lr_scheduler is not None:
        named.append(("optimizer.lr_scheduler.name", spec.optimizer.lr_scheduler.name))
    if spec.working_dir is not None and ANY_MODULE not in allowed:
        # Shipped code may shadow any module, allowed ones included: only with "*".
        why = shipping_refusal(SubmitPolicy(user_code_modules=allowed, code_root=code_root))
        problems.append(("working_dir", str(why)))
    elif spec.working_dir is not None:
        why = working_dir_problem(spec.working_dir, code_root)
        if why:
            problems.append(("working_dir", why))
    for field, name in named:
        if not re.match(IMPORT_PATH_PATTERN, name):
            continue  # a built-in
        module = name.partition(":")[0]
        if module_allowed(module, allowed):
            continue
        if allowed:
            why = (f"import paths are allowed only from the modules {', '.join(allowed)} "
                   f"({USER_CODE_SETTING})")
        else:
            why = (f"this service runs no user code: import paths need {USER_CODE_SETTING} "
                   "(the modules they may name, or '*'; with '*' `dynabatch submit "
                   "--working-dir DIR` ships your code)")
        problems.append((field, f"{name!r} is not allowed: {why}"))
    return problems


def path_problem(value: str, roots: Iterable[str], what: str) -> str | None:
    """Why ``value`` does not resolve (symlinks and ``..`` included) under one of ``roots``;
    None when it does. Relative paths are refused: the nodes that use them have another
    working directory than the service that checks them."""
    roots = tuple(roots)
    if not roots:
        return f"not allowed: this service accepts no {what}"
    if "://" in value:
        return uri_problem(value, roots)
    if any("://" in r for r in roots):  # a local path: only the local roots allow it
        local = tuple(r for r in roots if "://" not in r)
        return (path_problem(value, local, what) if local
                else f"{value!r} is outside the allowed locations ({', '.join(roots)})")
    if not Path(value).is_absolute():
        return f"{value!r} must be an absolute path"
    try:
        resolved = Path(value).resolve()
        allowed = [Path(root).resolve() for root in roots]
    except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, a NUL byte
        return f"{value!r} cannot be resolved ({' '.join(str(err).split())})"
    if any(resolved == root or resolved.is_relative_to(root) for root in allowed):
        return None
    return f"{value!r} is outside the allowed directories ({', '.join(roots)})"


def uri_problem(value: str, roots: tuple[str, ...]) -> str | None:
    """A URI (``s3://bucket/data``) is allowed under a root URI by prefix, whole segments
    only (``s3://bucket/data`` allows ``s3://bucket/data/x``, not ``s3://bucket/data2``);
    ``..`` is refused; ``file://`` is checked as the local path it names."""
    if value.startswith("file://"):
        local = value[len("file://"):]
        plain = [r for r in roots if "://" not in r]
        if plain and path_problem(local, plain, "dataset paths") is None:
            return None
    if "/../" in f"{value}/" or value.endswith("/.."):
        return f"{value!r} must not contain '..'"
    for root in roots:
        if "://" not in root:
            continue
        base = root.rstrip("/")
        if value.rstrip("/") == base or value.startswith(base + "/"):
            return None
    return f"{value!r} is outside the allowed locations ({', '.join(roots)})"


def check_paths(
    spec: JobSpec, data_roots: Iterable[str], checkpoint_root: str | None
) -> list[tuple[str, str]]:
    """(field, problem) for ``dataset.path`` (and ``dataset.tokenizer``, an hf model's
    ``model.options.pretrained`` folder) outside ``data_roots``, ``checkpoint.dir``
    outside ``checkpoint_root`` and ``checkpoint.from`` (a file the job reads) outside
    both."""
    data_roots = tuple(data_roots)
    problems = []
    if spec.dataset.path is not None:
        why = path_problem(spec.dataset.path, data_roots, "dataset paths")
        if why:
            problems.append(("dataset.path", why))
    # Files the job reads beside its data: the tokenizer, an hf model's pretrained folder.
    pretrained = spec.model.options.get("pretrained") if spec.model.name == "hf" else None
    # dataset.validation as a path of its own (a name is a split under dataset.path).
    val = spec.dataset.validation
    val_path = val if isinstance(val, str) and ("/" in val or ":" in val) else None
    for field, value in (("dataset.tokenizer", spec.dataset.tokenizer),
                         ("model.options.pretrained", pretrained),
                         ("dataset.validation", val_path)):
        if isinstance(value, str):
            why = path_problem(value, data_roots, "dataset paths")
            if why:
                problems.append((field, why))
    if spec.checkpoint.dir:  # "" means no checkpoints, as everywhere else
        roots = () if checkpoint_root is None else (checkpoint_root,)
        why = path_problem(spec.checkpoint.dir, roots, "checkpoint directories")
        if why:
            problems.append(("checkpoint.dir", why))
    if spec.checkpoint.from_:
        roots = (*(() if checkpoint_root is None else (checkpoint_root,)), *data_roots)
        why = path_problem(spec.checkpoint.from_, roots, "checkpoint files")
        if why:
            problems.append(("checkpoint.from", why))
    return problems


def check_artifacts(spec: JobSpec, artifact_root: str | None) -> list[tuple[str, str]]:
    """(field, problem) for an ``artifacts.dir`` or a ``tracking.tensorboard`` outside
    ``artifact_root`` (none allowed when it is unset): the job's outputs, the trained model
    and its event files, go where the operator allows them, under one setting."""
    roots = () if artifact_root is None else (artifact_root,)
    problems = []
    for field, value in (("artifacts.dir", spec.artifacts.dir),
                         ("tracking.tensorboard", spec.tracking.tensorboard)):
        if value:
            why = path_problem(value, roots, "artifacts directories (DYNABATCH_ARTIFACT_ROOT)")
            if why:
                problems.append((field, why))
    return problems


def check_builtin_options(spec: JobSpec) -> list[tuple[str, str]]:
    """(field, problem) for the options a built-in dataset (the file kinds too) or model does
    not take, from their tables, as ``dynabatch run`` checks them before Ray starts. The
    options of user code are left to the job: the service never imports it."""
    from dynabatch.actors.data.open import check_file_options
    from dynabatch.actors.workloads import WorkloadError
    from dynabatch.actors.workloads.datasets import check_dataset_options

    checks: list[tuple[Callable[[Any], None], Any]] = []
    if not re.match(IMPORT_PATH_PATTERN, spec.dataset.name):
        checks += [(check_dataset_options, spec.dataset), (check_file_options, spec.dataset)]
    if (spec.model.options and not re.match(IMPORT_PATH_PATTERN, spec.model.name)
            and spec.model.name != "hf"):
        # Only with options to check: the models' module imports torch, which this
        # service otherwise never loads. An hf config's keys are left to the job, as user
        # code is: checking them imports transformers (seconds); a hub id is refused by
        # the spec itself.
        from dynabatch.actors.workloads.models import check_model_options

        checks.append((check_model_options, spec.model))
    o = spec.optimizer
    if o.lr_scheduler is not None or not (o.name in BUILTIN_OPTIMIZERS
                                          or re.match(IMPORT_PATH_PATTERN, o.name)):
        # torch.optim classes by name and their options (torch, only for them).
        from dynabatch.actors.optim import check_optimizer

        checks.append((check_optimizer, spec))
    problems = []
    for check, section in checks:
        try:
            check(section)
        except WorkloadError as err:  # "dataset.options: unknown option ..."
            field, _, problem = " ".join(str(err).split()).partition(": ")
            problems.append((field, problem))
    return problems


def check_submission(spec: JobSpec, policy: SubmitPolicy) -> list[tuple[str, str]]:
    """Everything ``spec`` names that ``policy`` does not allow, and the built-ins' options
    it gets wrong; empty when it may run."""
    return [
        *check_user_code(spec, policy.user_code_modules, policy.code_root),
        *check_paths(spec, policy.data_roots, policy.checkpoint_root),
        *check_artifacts(spec, policy.artifact_root),
        *check_builtin_options(spec),
    ]
