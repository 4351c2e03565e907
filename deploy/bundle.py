"""The offline bundle (``make bundle``): every wheel a GPU node without network needs beyond
torch and numpy to run dynabatch's job path and ``bench/gpu_ray_check.py``.

What goes in: the closure of :data:`ROOTS` (Ray and what dynabatch's job path imports that
the GPU image lacks) over each wheel's ``Requires-Dist`` (evaluated for CPython 3.12 on
Linux x86-64, extras left out), minus what the GPU machine's image already holds
(:data:`GPU_IMAGE_HAS`). Every version is the committed lock's
(``requirements/runtime.lock``), every wheel is fetched for cp312 manylinux x86-64 with
``pip download --no-deps --only-binary=:all:`` and checked against the lock's sha256 hashes.

Ray is slimmed (unless ``--full``): its wheel is repacked without ``ray/jars/ray_dist.jar``
(Java support, 30.7 MB of the 79 MB wheel, which a Python job never loads), with the jar's
line removed from the wheel's ``RECORD`` so pip installs it (:func:`slim_wheel`). Its hash
then differs from the lock's, so ``manifest.json`` in the bundle records each wheel's own
sha256 (the slimmed one's, and the lock's hash of the wheel it was made from).

The bundle plus the working tree that travels to a GPU machine (tracked and untracked, not
ignored, files) must stay under ``--limit-mib`` (60): checked at the end, exit 1 otherwise.

Usage: python deploy/bundle.py [--out .bundle] [--full] [--lock requirements/runtime.lock]
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# What the job path needs beyond torch and numpy that is not already in the GPU image:
# Ray itself (its own needs follow from its metadata), pydantic (the spec and telemetry),
# tenacity (the service's retries, imported by the driver's path). Found by importing the
# job path (dynabatch.run, the coordinator, the worker) and listing the distributions of
# the modules it loaded, against GPU_IMAGE_HAS.
ROOTS = ("ray", "pydantic", "tenacity")
# Ray's jar: Java workers and cross-language calls only.
RAY_JAR = "ray/jars/ray_dist.jar"
# The Python packages of the GPU machine's image ('cuda'; the device notes' list as read on
# 2026-11-17), canonical names. A dependency named here is not bundled.
_IMAGE_PACKAGES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal
    annotated-doc anyio
    attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama
    contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler
    cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
    formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub
    humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
    lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
    matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
    mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
    nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
    nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
    opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
    pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
    pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
    pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
    requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
    seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
    tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
    torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
    typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
    xarray xxhash yarl zipp"""
GPU_IMAGE_HAS = frozenset(canonicalize_name(n) for n in _IMAGE_PACKAGES.split())
# The target: the GPU machine's Python (3.12) on Linux x86-64. pip matches a manylinux tag
# exactly, so the usual ones are all named (the device notes).
PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
MARKER_ENV = {
    "python_version": PYTHON_VERSION,
    "python_full_version": f"{PYTHON_VERSION}.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
MANIFEST = "manifest.json"
LIMIT_MIB = 60.0


class BundleError(Exception):
    """A problem with the bundle, said in one line (the lock, a download, a hash, the size)."""


# --- the lock ------------------------------------------------------------------------------


def parse_lock(path: Path) -> dict[str, tuple[str, frozenset[str]]]:
    """A uv/pip-compile lock (``name==version \\`` then ``--hash=sha256:...`` lines) as
    canonical name -> (version, its sha256 hashes)."""
    locked: dict[str, tuple[str, frozenset[str]]] = {}
    name = version = None
    hashes: set[str] = set()
    pin = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = pin.match(line)
        if m:
            if name:
                locked[name] = (version, frozenset(hashes))
            name, version, hashes = canonicalize_name(m.group(1)), m.group(2), set()
            continue
        h = re.search(r"--hash=sha256:([0-9a-f]{64})", line)
        if h:
            if name is None:
                raise BundleError(f"{path}:{n}: a hash before any pinned package")
            hashes.add(h.group(1))
    if name:
        locked[name] = (version, frozenset(hashes))
    if not locked:
        raise BundleError(f"{path}: no pinned packages (name==version lines)")
    return locked


# --- wheels --------------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_metadata(wheel: Path) -> dict[str, list[str]]:
    """The wheel's ``*.dist-info/METADATA`` headers (each name to its values)."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise BundleError(f"{wheel.name}: {len(names)} METADATA files, expected one")
        msg = Parser().parsestr(z.read(names[0]).decode("utf-8"))
    out: dict[str, list[str]] = {}
    for k, v in msg.items():
        out.setdefault(k, []).append(v)
    return out


def requirements_of(wheel: Path) -> list[str]:
    """The canonical names a wheel needs on CPython 3.12 / Linux x86-64, extras left out."""
    names = []
    for line in wheel_metadata(wheel).get("Requires-Dist", []):
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(MARKER_ENV):
            names.append(canonicalize_name(req.name))
    return names


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode("ascii")


def slim_wheel(src: Path, dest: Path, drop: tuple[str, ...]) -> list[str]:
    """Repack the wheel ``src`` into ``dest`` without the members named in ``drop`` (exact
    paths inside the wheel), and its ``RECORD`` without their lines, so the result installs
    as a whole wheel. Every other member keeps its bytes, date and permissions (Ray's
    executables stay executable). Returns the paths dropped; a name in ``drop`` that the
    wheel lacks is an error (the wheel is not the one this was written for)."""
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        missing = [d for d in drop if d not in names]
        if missing:
            raise BundleError(f"{src.name}: has no {missing[0]} to leave out")
        records = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)]
        if len(records) != 1:
            raise BundleError(f"{src.name}: {len(records)} RECORD files, expected one")
        record = records[0]
        rows = list(csv.reader(io.StringIO(zin.read(record).decode("utf-8"))))
        kept_rows = [r for r in rows if r and r[0] not in drop]
        if len(kept_rows) != len([r for r in rows if r]) - len(drop):
            raise BundleError(f"{src.name}: RECORD does not list every member it drops")
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(kept_rows)
        tmp = dest.with_name(dest.name + ".part")
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                if info.filename in drop:
                    continue
                data = buf.getvalue().encode("utf-8") if info.filename == record else None
                if data is None:
                    data = zin.read(info)
                # The original ZipInfo: name, date, permissions (external_attr) kept.
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
        tmp.replace(dest)
    return list(drop)


def check_record(wheel: Path) -> list[str]:
    """Problems with a wheel's ``RECORD``: members it does not list, lines for members that
    are not there, hashes that differ. Empty when the wheel is whole."""
    problems = []
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = next(n for n in names if re.fullmatch(r"[^/]+\.dist-info/RECORD", n))
        rows = [r for r in csv.reader(io.StringIO(z.read(record).decode("utf-8"))) if r]
        listed = {r[0] for r in rows}
        problems += [f"not in RECORD: {n}" for n in sorted(names - listed) if not n.endswith("/")]
        problems += [f"in RECORD, not in the wheel: {n}" for n in sorted(listed - names)]
        for path, digest, _size in rows:
            if digest and path in names and _record_hash(z.read(path)) != digest:
                problems.append(f"hash differs: {path}")
    return problems


# --- downloading ---------------------------------------------------------------------------


def download(name: str, version: str, dest: Path) -> Path:
    """``name==version`` as one cp312 manylinux x86-64 (or pure-Python) wheel into
    ``dest``, with pip (no dependencies: the closure is this script's)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        *[a for p in PLATFORMS for a in ("--platform", p)],
        "-d",
        str(dest),
        f"{name}=={version}",
    ]
    before = set(dest.glob("*.whl"))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise BundleError(f"pip download {name}=={version} for cp312 manylinux x86-64: {why}")
    got = [
        w
        for w in dest.glob("*.whl")
        if canonicalize_name(w.name.split("-")[0]) == name and w.name.split("-")[1] == version
    ]
    if len(got) != 1:
        new = sorted(p.name for p in set(dest.glob("*.whl")) - before)
        raise BundleError(f"pip download {name}=={version}: expected one wheel, got {new}")
    return got[0]


def closure(
    roots: tuple[str, ...],
    locked: dict[str, tuple[str, frozenset[str]]],
    fetch,
    skip: frozenset[str],
) -> dict[str, Path]:
    """Every package ``roots`` need (their ``Requires-Dist``, recursively), at the lock's
    versions, minus ``skip``: canonical name -> its wheel, as ``fetch(name, version)`` gives
    it. A needed package the lock lacks is an error."""
    wheels: dict[str, Path] = {}
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in wheels or name in skip:
            continue
        if name not in locked:
            raise BundleError(f"{name} is needed but not in the lock (run make lock)")
        wheels[name] = fetch(name, locked[name][0])
        todo += requirements_of(wheels[name])
    return wheels


# --- sizes ---------------------------------------------------------------------------------


def tree_bytes(root: Path) -> int:
    """Bytes of the working tree that travels to a GPU machine: tracked files and untracked
    files git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    total = 0
    for rel in out.decode().split("\0"):
        p = root / rel
        if rel and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# --- the bundle ----------------------------------------------------------------------------


def build(
    out: Path, lock: Path, full: bool, limit_mib: float, roots: tuple[str, ...] = ROOTS
) -> dict:
    """Make the bundle in ``out`` (emptied of wheels first) and return its manifest."""
    t0 = time.monotonic()
    locked = parse_lock(lock)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.whl"), out / MANIFEST]:
        old.unlink(missing_ok=True)
    entries = []
    with tempfile.TemporaryDirectory() as tmp:
        dl = Path(tmp)

        def fetch(name: str, version: str) -> Path:
            wheel = download(name, version, dl)
            digest = sha256_of(wheel)
            if digest not in locked[name][1]:
                raise BundleError(
                    f"{wheel.name}: sha256 {digest} is not among the lock's hashes for "
                    f"{name}=={version} ({lock})"
                )
            return wheel

        skip = GPU_IMAGE_HAS | {"torch", "numpy"}
        wheels = closure(roots, locked, fetch, skip)
        for name, wheel in sorted(wheels.items()):
            entry = {
                "name": name,
                "version": locked[name][0],
                "file": wheel.name,
                "lock_sha256": sha256_of(wheel),
            }
            if name == "ray" and not full:
                slim_wheel(wheel, out / wheel.name, (RAY_JAR,))
                entry["slimmed"] = {"dropped": [RAY_JAR], "from_bytes": wheel.stat().st_size}
            else:
                (out / wheel.name).write_bytes(wheel.read_bytes())
            entry["sha256"] = sha256_of(out / wheel.name)
            entry["bytes"] = (out / wheel.name).stat().st_size
            entries.append(entry)
    bundle_b = sum(e["bytes"] for e in entries)
    tree_b = tree_bytes(ROOT)
    manifest = {
        "python": PYTHON_VERSION,
        "platforms": list(PLATFORMS),
        "lock": str(lock.relative_to(ROOT) if lock.is_relative_to(ROOT) else lock),
        "full": full,
        "wheels": entries,
        "bundle_mib": round(bundle_b / 2**20, 2),
        "tree_mib": round(tree_b / 2**20, 2),
        "seconds": round(time.monotonic() - t0, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    total = (bundle_b + tree_b) / 2**20
    if total >= limit_mib:
        raise BundleError(
            f"the bundle ({bundle_b / 2**20:.1f} MiB) and the working tree "
            f"({tree_b / 2**20:.1f} MiB) come to {total:.1f} MiB, over {limit_mib:g} MiB"
        )
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / ".bundle"), help="the bundle's folder")
    ap.add_argument("--lock", default=str(ROOT / "requirements" / "runtime.lock"))
    ap.add_argument("--full", action="store_true", help="keep Ray's jar (no size check)")
    ap.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    args = ap.parse_args(argv)
    limit = float("inf") if args.full else args.limit_mib
    try:
        m = build(Path(args.out).resolve(), Path(args.lock).resolve(), args.full, limit)
    except (BundleError, OSError) as err:
        print(f"bundle: {err}", file=sys.stderr)
        return 1
    for e in m["wheels"]:
        note = " (slimmed: without its jar)" if "slimmed" in e else ""
        print(f"{e['file']}  {e['bytes'] / 2**20:6.2f} MiB{note}")
    print(
        f"bundle {m['bundle_mib']} MiB + working tree {m['tree_mib']} MiB = "
        f"{m['bundle_mib'] + m['tree_mib']:.1f} MiB in {args.out} ({m['seconds']} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
