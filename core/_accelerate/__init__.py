"""The private parts of Accelerate's module names (:mod:`kwplug.state`,
:mod:`kwplug.tracking`'s Accelerate names), in the layer on top of the Accelerator
(docs/architecture.md, "Layers").

- ``state_gradient``: ``GradientState``, re-exported by :mod:`kwplug.state`.
- ``tracker_placeholders``: Accelerate's tracker classes kwplug has no plugin for, served
  lazily by :mod:`kwplug.tracking`.

No face: each module is imported by its own path.
"""
