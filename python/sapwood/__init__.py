"""sapwood: speculative decoding with tree verification for hybrid linear-attention LLMs."""
from . import _core
from ._core import InputError, CapacityError
from .loading import available_backends, load
from .memory import estimate
from .model import Model
from .session import Chunk, Session

__version__ = "0.1.0"
__all__ = ["InputError", "CapacityError", "available_backends", "estimate", "load", "Model", "Chunk", "Session"]
