"""FAKE tensorrt_llm for trtprompt's tests only (see tests/fake_trtllm/README.md)."""

from tensorrt_llm.builder import BuildConfig, Engine, build
from tensorrt_llm.mapping import Mapping

__version__ = "1.2.1"
__all__ = ["BuildConfig", "Engine", "Mapping", "build", "__version__"]
