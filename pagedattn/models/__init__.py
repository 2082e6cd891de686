"""Model definitions and checkpoint loading."""
from pagedattn.models.loader import load_model
from pagedattn.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

__all__ = ["Qwen2Config", "Qwen2ForCausalLM", "load_model"]
