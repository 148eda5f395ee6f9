"""The private modules of the ``kwplug`` command (:mod:`kwplug.cli`, which parses the
arguments), in kwplug's top layer, "faces and tools" (docs/architecture.md, "Layers").

- ``child``: ``kwplug plugins``/``kwplug env`` run in a child process that names a plugin
  whose import ended it.
- ``launch``: ``kwplug launch`` (``accelerate launch``'s flags, run by ``torch.distributed.run``).
- ``launch_config``: Accelerate's launch configuration file.
- ``env_report``: ``kwplug env``'s text.

No face: :mod:`kwplug.cli` imports each module by its own path.
"""
