"""Errors the engine raises for requests it cannot accept.

Messages follow TensorRT-LLM's wording so clients see the same text on
either target; each error carries its code (trtprompt/error_codes.py).
"""

from trtprompt.error_codes import CapacityError, OverBoundError, RequestError, UnavailableError


class EngineRequestError(RequestError):
    """A request the engine refuses; the message is meant for the client."""


class InputTooLongError(EngineRequestError, OverBoundError):

    def __init__(self, prompt_len: int, max_input_len: int) -> None:
        super().__init__(
            f"Prompt length ({prompt_len}) exceeds maximum input length ({max_input_len})"
        )
        self.prompt_len = prompt_len
        self.max_input_len = max_input_len


class QueueFullError(EngineRequestError, CapacityError):

    def __init__(self, max_queue_size: int) -> None:
        super().__init__(
            f"queue full: {max_queue_size} requests already waiting (max_queue_size={max_queue_size})"
        )
        self.max_queue_size = max_queue_size


class DuplicateRequestError(EngineRequestError):
    pass


class EngineStoppingError(EngineRequestError, UnavailableError):
    pass
