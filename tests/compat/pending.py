"""EXPECTED FAILURES, pending work: the one list for the lead to prune after each merge.

Checks of Accelerate's shipped test scripts that pass under Accelerate and do not pass on
kwplug today because the feature they need is being built (issue 17, items 1-3). Keys are
``<script>::<check>`` as tests/compat prints them; the value names the missing piece.
A listed check that passes on kwplug fails the test ("prune it"), so the list cannot go stale.
Permanent, deliberate differences do not belong here: they are rows of the "Accelerate's
shipped test scripts" table in docs/migrating-from-accelerate.md, with their reason.
"""

from __future__ import annotations

PENDING: dict[str, str] = {}
