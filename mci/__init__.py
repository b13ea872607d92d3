"""mci — mission-critical inference for DeepSeek-V3-class models."""

__version__ = "0.1.0"
