"""The image's requirements: pyproject.toml's dependencies, with Ray's `default` extra added
(the dashboard agent behind --metrics-export-port needs it). Used by deploy/Dockerfile:

    python deploy/requirements.py pyproject.toml > requirements.txt
"""

import re
import sys
import tomllib

with open(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
for dep in deps:
    m = re.match(r"^ray\[([^\]]*)\](.*)$", dep)
    if m:
        extras = sorted({e.strip() for e in m.group(1).split(",") if e.strip()} | {"default"})
        dep = f"ray[{','.join(extras)}]{m.group(2)}"
    print(dep)
