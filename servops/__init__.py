"""servops: repeatable remote operations for LLM inference servers on GPU hosts."""

__version__ = "0.1.0"
