"""Suite-wide settings.

Hypothesis' per-example deadline is a timing assertion, and timing belongs to bench/, not
to tests: on a loaded 2-core machine a correct example can take longer than 200 ms. The
``too_slow`` health check is off for the same reason. Everything else (the search, the
shrinking, the example database off) is Hypothesis' default.
"""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "dynabatch", deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
settings.load_profile("dynabatch")
