"""Fake of tensorrt_llm.quantization: only QuantAlgo (a string enum, as in 1.x)."""

from enum import Enum


class QuantAlgo(str, Enum):
    W8A16 = "W8A16"
    W4A16 = "W4A16"
    W4A16_AWQ = "W4A16_AWQ"
    W4A8_AWQ = "W4A8_AWQ"
    FP8 = "FP8"
    INT8 = "INT8"
    NVFP4 = "NVFP4"
