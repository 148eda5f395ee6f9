"""The private modules of kwplug's lowest layer, the plugin contracts (docs/architecture.md,
"Layers"): what the public contract modules (:mod:`kwplug.hookspecs`, :mod:`kwplug.tracking`,
:mod:`kwplug.comm_hooks`) are built from, and the lazy tables of kwplug's faces. They import
nothing of kwplug above the contracts.

- ``hookinfo``: how a hook spec declares itself (policies, ``HookInfo``, ``spec``).
- ``answers``: the types hook answers take (``AutocastFactory``, ``DeviceChoice``).
- ``additive``: the ``ADDITIVE`` policy's merge of plugins' name -> value answers.
- ``lazy``: the PEP 562 re-export tables of ``kwplug``, ``kwplug.utils`` and
  ``kwplug.tracking``; ``BUILTIN_HANDLERS``.
- ``pristine``: default objects (handlers, option objects) built once and handed out as
  copies while the environment is unchanged.
- ``environ``: ``os.environ`` read without the exception a missing name costs.

No face: each module is imported by its own path (the names are re-exported publicly by
:mod:`kwplug.hookspecs`, :mod:`kwplug.tracking` and :mod:`kwplug.comm_hooks`).
"""
