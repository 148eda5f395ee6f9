"""PLACEHOLDER being written by a helper."""
from enum import Enum
import attrs
from kwplug.handler import KwargsHandler
class DDPCommunicationHookType(str, Enum):
    NO = "no"
@attrs.define
class DistributedDataParallelKwargs(KwargsHandler):
    pass
