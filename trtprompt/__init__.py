"""trtprompt: bounded inference engines for Hugging Face decoders, served behind Triton."""

__version__ = "0.1.0"
