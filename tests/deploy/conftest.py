"""tests/deploy: the docker-compose stack for real (`make deploy-test`, after `make images`).

Not part of `make test`: collected only with DYNABATCH_DEPLOY_TEST=1 (the Makefile sets it).
"""

import os

collect_ignore_glob = [] if os.environ.get("DYNABATCH_DEPLOY_TEST") == "1" else ["test_*.py"]
