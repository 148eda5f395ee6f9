"""EXPECTED FAILURES, pending work: the one list for the lead to prune after each merge.

Checks of Accelerate's shipped test scripts that pass under Accelerate and do not pass on
kwplug today because the feature they need is being built. Keys are ``<script>::<check>``
as tests/compat prints them; the value says what the check meets (``python
tests/compat/compat_harness.py --lenient`` shows what a check meets beyond a missing import).
A listed check that passes on kwplug fails the test ("prune it"), so the list cannot go stale.
Permanent, deliberate differences do not belong here: they are rows of the "Accelerate's
shipped test scripts" table in docs/migrating-from-accelerate.md, with their reason.
"""

from __future__ import annotations

PENDING: dict[str, str] = {
    # Empty: every check that passes under Accelerate passes on kwplug, or is a row of the
    # migration table's shipped-scripts section (a deliberate difference, with its reason).
}
