"""PLACEHOLDER being written by a helper."""
import attrs
from kwplug.handler import KwargsHandler
@attrs.define
class ProfileKwargs(KwargsHandler):
    pass
